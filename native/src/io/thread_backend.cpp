// Fallback backend: a pthread pool doing blocking pread/pwrite, for
// kernels or sandboxes without io_uring.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "backend.h"

namespace offloadd::io {
namespace {

int64_t transfer_once(const Transfer& t) {
  const Request& r = t.request;
  const ssize_t n = r.op == Op::kRead ? pread(r.fd, t.cursor(), t.chunk(), off_t(t.position()))
                                      : pwrite(r.fd, t.cursor(), t.chunk(), off_t(t.position()));
  return n < 0 ? -int64_t(errno) : int64_t(n);
}

Completion run_request(const Request& request) {
  Transfer t{request};
  for (;;) {
    const int64_t result =
        t.request.fault_errno != 0 ? -int64_t(t.request.fault_errno) : transfer_once(t);
    if (t.advance(result)) return t.completion();
  }
}

class ThreadBackend final : public Backend {
 public:
  explicit ThreadBackend(unsigned num_threads) {
    for (unsigned i = 0; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  // Queued requests still run: their buffers were handed to us and the
  // caller may be waiting on their completions.
  ~ThreadBackend() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    queue_ready_.notify_all();
    for (std::thread& worker : workers_) worker.join();
  }

  void submit(const Request& request) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(request);
    }
    queue_ready_.notify_one();
  }

  std::vector<Completion> reap() override {
    event_fd_.drain();
    std::vector<Completion> finished;
    std::lock_guard<std::mutex> lock(mutex_);
    finished.swap(finished_);
    return finished;
  }

  const char* kind() const override { return "threads"; }

 private:
  void worker_loop() {
    for (;;) {
      Request request;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        queue_ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        request = queue_.front();
        queue_.pop_front();
      }
      const Completion done = run_request(request);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        finished_.push_back(done);
      }
      event_fd_.signal();
    }
  }

  std::mutex mutex_;
  std::condition_variable queue_ready_;
  std::deque<Request> queue_;
  std::vector<Completion> finished_;
  std::vector<std::thread> workers_;
  bool stopping_ = false;
};

}  // namespace

std::unique_ptr<Backend> make_thread_backend(unsigned num_threads) {
  return std::make_unique<ThreadBackend>(num_threads);
}

}  // namespace offloadd::io
