// Python bindings: offloadd._native.
//
// Buffers cross as raw addresses: the Python wrappers (offloadd/compute/adam.py,
// offloadd/swap/ioengine.py) validate dtype, size, contiguity and writability
// and keep the owning objects alive, so this layer stays a thin,
// allocation-free call.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

#include "adam/adam_dispatch.h"
#include "adam/convert.h"
#include "io/backend.h"
#include "thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace offloadd {
namespace {

// Where an out-of-place step reads its state (`source`, in the order of `written`);
// none (an empty list) reads it where it writes it.
std::vector<uintptr_t> state_sources(const std::vector<uintptr_t>& source,
                                     std::initializer_list<uintptr_t> written) {
  if (source.empty()) return std::vector<uintptr_t>(written);
  if (source.size() != written.size()) {
    throw std::invalid_argument("source needs one address per state buffer (" +
                                std::to_string(written.size()) + "), got " +
                                std::to_string(source.size()));
  }
  return source;
}

void adam_step(uintptr_t master, uintptr_t exp_avg, uintptr_t exp_avg_sq, uintptr_t grad,
               int grad_dtype, uintptr_t param_out, int out_dtype, size_t numel, int64_t step,
               double lr, double beta1, double beta2, double eps, double weight_decay,
               bool decoupled_weight_decay, double grad_scale, const std::string& kernel,
               int num_threads, const std::vector<uintptr_t>& source) {
  if (grad_dtype < 0 || grad_dtype > 1) throw std::invalid_argument("grad_dtype must be 0 or 1");
  if (out_dtype < 0 || out_dtype > 3) throw std::invalid_argument("out_dtype must be in 0..3");
  const adam::KernelFn fn = adam::find_kernel(kernel);
  const std::vector<uintptr_t> in = state_sources(source, {master, exp_avg, exp_avg_sq});
  const adam::Buffers buffers{reinterpret_cast<float*>(master),
                              reinterpret_cast<float*>(exp_avg),
                              reinterpret_cast<float*>(exp_avg_sq),
                              reinterpret_cast<const void*>(grad),
                              adam::GradDtype(grad_dtype),
                              reinterpret_cast<void*>(param_out),
                              adam::OutDtype(out_dtype),
                              reinterpret_cast<const float*>(in[0]),
                              reinterpret_cast<const float*>(in[1]),
                              reinterpret_cast<const float*>(in[2])};
  const adam::StepScalars scalars = adam::make_step_scalars(
      step, lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, grad_scale);
  nb::gil_scoped_release no_gil;  // after argument checks: those may raise
  adam::run_step(fn, scalars, buffers, numel, num_threads);
}

// exp_avg / exp_avg_sq in a compact format (offloadd/formats.py): moment_format 1 is
// bf16 (rounded with rounding_key), 2 is blockwise8 (the *_scales addresses used).
void adam_step_compact(uintptr_t master, uintptr_t grad, int grad_dtype, uintptr_t param_out,
                       int out_dtype, size_t numel, int moment_format, uintptr_t exp_avg,
                       uintptr_t exp_avg_sq, uintptr_t exp_avg_scales,
                       uintptr_t exp_avg_sq_scales, uint32_t rounding_key, int64_t step,
                       double lr, double beta1, double beta2, double eps, double weight_decay,
                       bool decoupled_weight_decay, double grad_scale, const std::string& kernel,
                       int num_threads, const std::vector<uintptr_t>& source) {
  if (grad_dtype < 0 || grad_dtype > 1) throw std::invalid_argument("grad_dtype must be 0 or 1");
  if (out_dtype < 0 || out_dtype > 3) throw std::invalid_argument("out_dtype must be in 0..3");
  if (moment_format != 1 && moment_format != 2) {
    throw std::invalid_argument("moment_format must be 1 (bf16) or 2 (blockwise8)");
  }
  const adam::CompactKernelFn fn = adam::find_compact_kernel(kernel);
  // Blockwise8 reads its scales too (bf16 has none: 0 stands for them).
  const std::vector<uintptr_t> in = state_sources(
      source, moment_format == 1
                  ? std::initializer_list<uintptr_t>{master, exp_avg, exp_avg_sq}
                  : std::initializer_list<uintptr_t>{master, exp_avg, exp_avg_sq,
                                                     exp_avg_scales, exp_avg_sq_scales});
  const adam::Buffers buffers{reinterpret_cast<float*>(master),
                              nullptr,
                              nullptr,
                              reinterpret_cast<const void*>(grad),
                              adam::GradDtype(grad_dtype),
                              reinterpret_cast<void*>(param_out),
                              adam::OutDtype(out_dtype),
                              reinterpret_cast<const float*>(in[0]),
                              nullptr,
                              nullptr};
  const adam::CompactMoments moments{adam::MomentFormat(moment_format),
                                     reinterpret_cast<void*>(exp_avg),
                                     reinterpret_cast<void*>(exp_avg_sq),
                                     reinterpret_cast<float*>(exp_avg_scales),
                                     reinterpret_cast<float*>(exp_avg_sq_scales),
                                     rounding_key,
                                     reinterpret_cast<const void*>(in[1]),
                                     reinterpret_cast<const void*>(in[2]),
                                     reinterpret_cast<const float*>(in.size() > 3 ? in[3] : 0),
                                     reinterpret_cast<const float*>(in.size() > 3 ? in[4] : 0)};
  const adam::StepScalars scalars = adam::make_step_scalars(
      step, lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, grad_scale);
  nb::gil_scoped_release no_gil;  // after argument checks: those may raise
  adam::run_compact_step(fn, scalars, buffers, moments, numel, num_threads);
}

// fp32 `src` rounded into `dst` of out_dtype (1 fp32, 2 bf16, 3 fp16), as
// `dst.copy_(src)` rounds (to nearest, ties to even): a reverted step's parameter.
void round_into(uintptr_t src, uintptr_t dst, int out_dtype, size_t numel) {
  if (out_dtype < 1 || out_dtype > 3) throw std::invalid_argument("out_dtype must be in 1..3");
  const float* in = reinterpret_cast<const float*>(src);
  nb::gil_scoped_release no_gil;
  if (out_dtype == 1) {
    std::memmove(reinterpret_cast<void*>(dst), in, numel * sizeof(float));
    return;
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  if (out_dtype == 2) {
    for (size_t i = 0; i < numel; ++i) out[i] = adam::bf16_from_float(in[i]);
  } else {
    for (size_t i = 0; i < numel; ++i) out[i] = adam::fp16_from_float(in[i]);
  }
}

// Owns one backend; closing it waits for in-flight IO (see the backends).
class IoEngine {
 public:
  IoEngine(const std::string& kind, unsigned queue_depth, unsigned num_threads) {
    if (kind == "io_uring") {
      backend_ = io::make_io_uring_backend(queue_depth);
    } else if (kind == "threads") {
      backend_ = io::make_thread_backend(num_threads);
    } else {
      throw std::invalid_argument("kind must be 'io_uring' or 'threads', got '" + kind + "'");
    }
  }

  std::string kind() const { return backend().kind(); }
  int event_fd() const { return backend().event_fd(); }

  void submit(uint64_t tag, int op, int fd, uint64_t offset, uintptr_t addr, uint64_t nbytes,
              int fault_errno) {
    if (op != 0 && op != 1) throw std::invalid_argument("op must be 0 (read) or 1 (write)");
    backend().submit({tag, io::Op(op), fd, offset, reinterpret_cast<char*>(addr), nbytes,
                      fault_errno});
  }

  std::vector<std::tuple<uint64_t, int, uint64_t>> reap() {
    std::vector<std::tuple<uint64_t, int, uint64_t>> out;
    for (const io::Completion& c : backend().reap()) out.emplace_back(c.tag, c.error, c.nbytes_done);
    return out;
  }

  // Blocks until in-flight requests finish, so release the GIL meanwhile.
  void close() {
    std::unique_ptr<io::Backend> doomed = std::move(backend_);
    nb::gil_scoped_release no_gil;
    doomed.reset();
  }

 private:
  io::Backend& backend() const {
    if (!backend_) throw std::runtime_error("IoEngine is closed");
    return *backend_;
  }
  std::unique_ptr<io::Backend> backend_;
};

}  // namespace
}  // namespace offloadd

NB_MODULE(_native, m) {
  using offloadd::IoEngine;
  m.doc() = "offloadd native kernels: fused CPU Adam and the async file IO engine";

  // std::system_error carries an errno; surface it as OSError(errno, message).
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::system_error& e) {
      PyErr_SetObject(PyExc_OSError,
                      nb::make_tuple(e.code().value(), std::string(e.what())).ptr());
    }
  });

  m.def("adam_kernels", &offloadd::adam::supported_kernels,
        "Kernels this CPU supports, best first.");
  m.def("available_cpus", &offloadd::available_cpus);
  m.def("adam_step", &offloadd::adam_step, "master"_a, "exp_avg"_a, "exp_avg_sq"_a, "grad"_a,
        "grad_dtype"_a, "param_out"_a, "out_dtype"_a, "numel"_a, "step"_a, "lr"_a, "beta1"_a,
        "beta2"_a, "eps"_a, "weight_decay"_a, "decoupled_weight_decay"_a, "grad_scale"_a,
        "kernel"_a, "num_threads"_a, "source"_a = std::vector<uintptr_t>{});
  m.def("adam_step_compact", &offloadd::adam_step_compact, "master"_a, "grad"_a, "grad_dtype"_a,
        "param_out"_a, "out_dtype"_a, "numel"_a, "moment_format"_a, "exp_avg"_a,
        "exp_avg_sq"_a, "exp_avg_scales"_a, "exp_avg_sq_scales"_a, "rounding_key"_a, "step"_a,
        "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "decoupled_weight_decay"_a,
        "grad_scale"_a, "kernel"_a, "num_threads"_a, "source"_a = std::vector<uintptr_t>{});

  m.def("round_into", &offloadd::round_into, "src"_a, "dst"_a, "out_dtype"_a, "numel"_a,
        "fp32 src rounded into dst (1 fp32, 2 bf16, 3 fp16) to nearest, ties to even.");

  nb::class_<IoEngine>(m, "IoEngine")
      .def(nb::init<const std::string&, unsigned, unsigned>(), "kind"_a, "queue_depth"_a,
           "num_threads"_a)
      .def_prop_ro("kind", &IoEngine::kind)
      .def_prop_ro("event_fd", &IoEngine::event_fd)
      .def("submit", &IoEngine::submit, "tag"_a, "op"_a, "fd"_a, "offset"_a, "addr"_a,
           "nbytes"_a, "fault_errno"_a)
      .def("reap", &IoEngine::reap)
      .def("close", &IoEngine::close);
}
