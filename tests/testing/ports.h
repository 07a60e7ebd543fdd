// Free TCP ports on 127.0.0.1 for tests (bound to port 0, read back, released).
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace dtrain::testing {

inline std::vector<std::string> free_loopback_addresses(int n) {
  std::vector<int> fds;
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    socklen_t len = sizeof(a);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    out.push_back("127.0.0.1:" + std::to_string(ntohs(a.sin_port)));
    fds.push_back(fd);  // held until all are chosen, so they are distinct
  }
  for (int fd : fds) ::close(fd);
  return out;
}

}  // namespace dtrain::testing
