// Asynchronous file IO backends behind one interface.
//
// A backend accepts read/write requests on raw addresses and reports
// completions through an eventfd, so an asyncio loop can wait on it with
// add_reader() and never block: the loop calls reap() when the eventfd is
// readable and gets every finished request since the last call.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace offloadd::io {

enum class Op : uint8_t { kRead = 0, kWrite = 1 };

struct Request {
  uint64_t tag;        // caller's id, echoed in the completion
  Op op;
  int fd;
  uint64_t offset;
  char* addr;          // must stay valid until the completion is reaped
  uint64_t nbytes;
  int fault_errno;     // test hook: nonzero fails the request with this errno, file untouched
};

struct Completion {
  uint64_t tag;
  int error;             // 0 or a positive errno
  uint64_t nbytes_done;  // with error == 0, less than nbytes means end of file / no progress
};

// The retry policy both backends share.  A transfer that moved some bytes
// continues with the remainder (the kernel may split large or buffered IO);
// one that moved none ends the request short; a negative result is an errno.
struct Transfer {
  // One read/write moves at most this much: Linux caps a transfer just
  // under 2 GiB and io_uring's length field is 32 bits.
  static constexpr uint64_t kMaxChunk = uint64_t(1) << 30;

  // -EAGAIN / -EINTR say "try again", not "failed": io_uring returns them for a
  // request the kernel could not start right now (e.g. a full device queue).
  static constexpr unsigned kMaxTransientRetries = 64;

  Request request{};
  uint64_t done = 0;
  int error = 0;
  unsigned retries = 0;

  static bool is_transient(int64_t result) { return result == -EAGAIN || result == -EINTR; }

  // Applies one syscall/CQE result; true when the request is finished.  A
  // transient result leaves it unfinished: the caller issues the same chunk again
  // (an injected transient fault is consumed, so the retry is the real transfer).
  bool advance(int64_t result) {
    if (is_transient(result) && retries < kMaxTransientRetries) {
      ++retries;
      request.fault_errno = 0;
      return false;
    }
    if (result < 0) {
      error = int(-result);
      return true;
    }
    if (result == 0) return true;
    done += uint64_t(result);
    return done >= request.nbytes;
  }
  char* cursor() const { return request.addr + done; }
  uint64_t position() const { return request.offset + done; }
  uint64_t chunk() const {
    const uint64_t left = request.nbytes - done;
    return left < kMaxChunk ? left : kMaxChunk;
  }
  Completion completion() const { return {request.tag, error, done}; }
};

// Non-blocking eventfd owned by a backend; signalled once per completion batch.
class EventFd {
 public:
  EventFd();
  ~EventFd();
  EventFd(const EventFd&) = delete;
  EventFd& operator=(const EventFd&) = delete;
  int get() const { return fd_; }
  void signal();
  void drain();  // clears the readable state; pending completions are then collected

 private:
  int fd_;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Never blocks on the IO itself; requests beyond the queue depth wait in a backlog.
  virtual void submit(const Request& request) = 0;
  // Non-blocking: completions finished since the previous call.
  virtual std::vector<Completion> reap() = 0;
  virtual const char* kind() const = 0;
  int event_fd() const { return event_fd_.get(); }

 protected:
  EventFd event_fd_;
};

// Throws std::system_error when the kernel refuses io_uring (old kernel,
// seccomp, io_uring_disabled sysctl), so callers can fall back to threads.
std::unique_ptr<Backend> make_io_uring_backend(unsigned queue_depth);
std::unique_ptr<Backend> make_thread_backend(unsigned num_threads);

}  // namespace offloadd::io
