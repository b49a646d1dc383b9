#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

#include "backend.h"

namespace offloadd::io {

EventFd::EventFd() : fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
}

EventFd::~EventFd() { close(fd_); }

void EventFd::signal() {
  const uint64_t one = 1;
  // EAGAIN only when the counter would overflow, i.e. it is already readable.
  while (write(fd_, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

void EventFd::drain() {
  uint64_t count;
  while (read(fd_, &count, sizeof(count)) < 0 && errno == EINTR) {
  }
}

}  // namespace offloadd::io
