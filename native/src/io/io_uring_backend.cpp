// io_uring backend written against the raw syscalls (no liburing).
//
// All ring access happens under one mutex from the thread that owns the
// asyncio loop, so the only concurrency is with the kernel: the SQ tail and
// CQ head we publish with release stores, the CQ tail we read with acquire.
// Completions are signalled through an eventfd registered with the ring.
#include <linux/io_uring.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <mutex>
#include <system_error>

#include "backend.h"

namespace offloadd::io {
namespace {

int sys_io_uring_setup(unsigned entries, io_uring_params* params) {
  return int(syscall(__NR_io_uring_setup, entries, params));
}

int sys_io_uring_enter(int ring_fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return int(syscall(__NR_io_uring_enter, ring_fd, to_submit, min_complete, flags, nullptr, 0));
}

int sys_io_uring_register(int ring_fd, unsigned opcode, const void* arg, unsigned nr_args) {
  return int(syscall(__NR_io_uring_register, ring_fd, opcode, arg, nr_args));
}

[[noreturn]] void throw_errno(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// One mmap'ed region, unmapped on destruction.
struct Mapping {
  void* addr = MAP_FAILED;
  size_t size = 0;
  Mapping() = default;
  Mapping(int fd, size_t length, off_t offset) : size(length) {
    addr = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, offset);
    if (addr == MAP_FAILED) throw_errno("mmap io_uring ring");
  }
  ~Mapping() {
    if (addr != MAP_FAILED) munmap(addr, size);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  template <class T>
  T* at(uint32_t byte_offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(addr) + byte_offset);
  }
};

// Owns the ring fd; closed last, after the mappings.
struct RingFd {
  int fd;
  explicit RingFd(int value) : fd(value) {
    if (fd < 0) throw_errno("io_uring_setup");
  }
  ~RingFd() { close(fd); }
  RingFd(const RingFd&) = delete;
  RingFd& operator=(const RingFd&) = delete;
};

// A request slot: its index is the SQE user_data, and it keeps the iovec
// alive for the kernel until the completion arrives.
struct Slot {
  Transfer transfer;
  iovec iov{};
};

class IoUringBackend final : public Backend {
 public:
  explicit IoUringBackend(unsigned queue_depth)
      : ring_(setup(queue_depth, &params_)),
        sq_map_(ring_.fd, sq_ring_bytes(), IORING_OFF_SQ_RING),
        cq_map_(ring_.fd, cq_ring_bytes(), IORING_OFF_CQ_RING),
        sqe_map_(ring_.fd, params_.sq_entries * sizeof(io_uring_sqe), IORING_OFF_SQES) {
    const int efd = event_fd();
    if (sys_io_uring_register(ring_.fd, IORING_REGISTER_EVENTFD, &efd, 1) < 0) {
      throw_errno("io_uring_register(EVENTFD)");
    }
    slots_.resize(params_.sq_entries);
    for (uint32_t i = params_.sq_entries; i > 0; --i) free_slots_.push_back(i - 1);
  }

  // Hazard (use after unmap): the kernel may still be writing into request
  // buffers and the CQ ring; wait for every in-flight request before the
  // rings go away.
  ~IoUringBackend() override {
    std::lock_guard<std::mutex> lock(mutex_);
    backlog_.clear();
    std::vector<Completion> ignored;
    while (free_slots_.size() < slots_.size()) {
      if (to_submit_ == 0 && sys_io_uring_enter(ring_.fd, 0, 1, IORING_ENTER_GETEVENTS) < 0 &&
          errno != EINTR) {
        break;  // nothing more can complete; do not spin
      }
      enter_pending(ignored);
      drain_cq(ignored);
    }
  }

  void submit(const Request& request) override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Completion> failed;
    // FIFO: a request never overtakes the backlog, which reap() refills from.
    if (free_slots_.empty() || !backlog_.empty()) {
      backlog_.push_back(request);
      return;
    }
    start(request);
    enter_pending(failed);
    publish_failures(failed);
  }

  std::vector<Completion> reap() override {
    event_fd_.drain();
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Completion> finished;
    finished.swap(failed_);
    drain_cq(finished);
    while (!free_slots_.empty() && !backlog_.empty()) {
      start(backlog_.front());
      backlog_.pop_front();
    }
    std::vector<Completion> failed;
    enter_pending(failed);
    publish_failures(failed);
    return finished;
  }

  const char* kind() const override { return "io_uring"; }

 private:
  static int setup(unsigned queue_depth, io_uring_params* params) {
    std::memset(params, 0, sizeof(*params));
    return sys_io_uring_setup(queue_depth, params);
  }
  size_t sq_ring_bytes() const { return params_.sq_off.array + params_.sq_entries * sizeof(uint32_t); }
  size_t cq_ring_bytes() const {
    return params_.cq_off.cqes + params_.cq_entries * sizeof(io_uring_cqe);
  }

  void start(const Request& request) {
    const uint32_t slot = free_slots_.back();
    free_slots_.pop_back();
    slots_[slot].transfer = Transfer{request};
    push_sqe(slot);
  }

  // Queues the slot's next chunk (the whole request, or the remainder after
  // a partial transfer).  Every slot owns at most one SQE, and there are as
  // many slots as SQ entries, so the SQ never overflows and, with the CQ
  // twice the SQ, neither does the CQ.
  void push_sqe(uint32_t slot_index) {
    Slot& slot = slots_[slot_index];
    const Transfer& t = slot.transfer;
    const uint32_t tail = *sq_map_.at<uint32_t>(params_.sq_off.tail);
    const uint32_t index = tail & *sq_map_.at<uint32_t>(params_.sq_off.ring_mask);
    io_uring_sqe* sqe = sqe_map_.at<io_uring_sqe>(0) + index;
    std::memset(sqe, 0, sizeof(*sqe));
    sqe->user_data = slot_index;
    if (t.request.fault_errno != 0) {
      sqe->opcode = IORING_OP_NOP;  // travels the real completion path, touches no file
    } else {
      slot.iov = {t.cursor(), size_t(t.chunk())};
      sqe->opcode = t.request.op == Op::kRead ? IORING_OP_READV : IORING_OP_WRITEV;
      sqe->fd = t.request.fd;
      sqe->off = t.position();
      sqe->addr = reinterpret_cast<uint64_t>(&slot.iov);
      sqe->len = 1;
    }
    sq_map_.at<uint32_t>(params_.sq_off.array)[index] = index;
    __atomic_store_n(sq_map_.at<uint32_t>(params_.sq_off.tail), tail + 1, __ATOMIC_RELEASE);
    ++to_submit_;
  }

  // Hands queued SQEs to the kernel.  If the kernel refuses them all (e.g.
  // ENOMEM), they are withdrawn from the ring and failed with that errno so
  // no request is ever silently stuck.
  void enter_pending(std::vector<Completion>& failed) {
    unsigned enter_retries = 0;
    while (to_submit_ > 0) {
      const int submitted = sys_io_uring_enter(ring_.fd, to_submit_, 0, 0);
      if (submitted >= 0) {
        to_submit_ -= unsigned(submitted);
        if (submitted == 0) break;
        continue;
      }
      if (errno == EINTR) continue;
      // EAGAIN/EBUSY: the kernel is short of resources or has completions to hand
      // back first; reaping them makes room, so try again a bounded number of times.
      if ((errno == EAGAIN || errno == EBUSY) && enter_retries++ < Transfer::kMaxTransientRetries) {
        std::vector<Completion> reaped;
        drain_cq(reaped);
        parked_.insert(parked_.end(), reaped.begin(), reaped.end());
        sched_yield();
        continue;
      }
      withdraw_unsubmitted(errno, failed);
    }
  }

  void withdraw_unsubmitted(int error, std::vector<Completion>& failed) {
    uint32_t* tail_ptr = sq_map_.at<uint32_t>(params_.sq_off.tail);
    const uint32_t mask = *sq_map_.at<uint32_t>(params_.sq_off.ring_mask);
    uint32_t tail = *tail_ptr;
    for (; to_submit_ > 0; --to_submit_) {
      --tail;
      const auto slot = uint32_t(sqe_map_.at<io_uring_sqe>(0)[tail & mask].user_data);
      slots_[slot].transfer.error = error;
      failed.push_back(slots_[slot].transfer.completion());
      free_slots_.push_back(slot);
    }
    __atomic_store_n(tail_ptr, tail, __ATOMIC_RELEASE);
  }

  // Completions found outside reap() are parked and announced via the eventfd.
  void publish_failures(std::vector<Completion>& failed) {
    failed.insert(failed.end(), parked_.begin(), parked_.end());
    parked_.clear();
    if (failed.empty()) return;
    failed_.insert(failed_.end(), failed.begin(), failed.end());
    event_fd_.signal();
  }

  void drain_cq(std::vector<Completion>& finished) {
    uint32_t* head_ptr = cq_map_.at<uint32_t>(params_.cq_off.head);
    const uint32_t mask = *cq_map_.at<uint32_t>(params_.cq_off.ring_mask);
    const io_uring_cqe* cqes = cq_map_.at<io_uring_cqe>(params_.cq_off.cqes);
    uint32_t head = *head_ptr;
    const uint32_t tail = __atomic_load_n(cq_map_.at<uint32_t>(params_.cq_off.tail), __ATOMIC_ACQUIRE);
    for (; head != tail; ++head) {
      const io_uring_cqe& cqe = cqes[head & mask];
      complete(uint32_t(cqe.user_data), cqe.res, finished);
    }
    __atomic_store_n(head_ptr, head, __ATOMIC_RELEASE);
  }

  void complete(uint32_t slot_index, int32_t result, std::vector<Completion>& finished) {
    Transfer& t = slots_[slot_index].transfer;
    if (t.request.fault_errno != 0) result = -t.request.fault_errno;
    if (!t.advance(result)) {
      push_sqe(slot_index);  // partial transfer: continue with the remainder
      return;
    }
    finished.push_back(t.completion());
    free_slots_.push_back(slot_index);
  }

  io_uring_params params_{};
  RingFd ring_;
  Mapping sq_map_;
  Mapping cq_map_;
  Mapping sqe_map_;
  std::mutex mutex_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_slots_;
  std::deque<Request> backlog_;
  std::vector<Completion> failed_;  // failed at submission, returned by the next reap()
  std::vector<Completion> parked_;  // reaped while retrying a submission, returned by reap()
  unsigned to_submit_ = 0;          // SQEs in the ring the kernel has not consumed yet
};

}  // namespace

std::unique_ptr<Backend> make_io_uring_backend(unsigned queue_depth) {
  return std::make_unique<IoUringBackend>(queue_depth);
}

}  // namespace offloadd::io
