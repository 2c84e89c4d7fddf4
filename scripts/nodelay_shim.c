/* TCP_NODELAY on every socket a process accepts, for bench_gateway's "sglang-nodelay" front.
 *
 * sglang-router 0.3.2 answers a stream with its headers in one write and the first chunk in the next, on
 * a socket with Nagle's algorithm on: whenever the client has not yet acknowledged the headers, the first
 * chunk waits for the client's delayed ACK (about 40 ms). Loaded with LD_PRELOAD, this library sets
 * TCP_NODELAY on each accepted socket, so the benchmark can also compare against sglang-router without
 * that delay. Built by bench_gateway.py with the system's C compiler: cc -shared -fPIC.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

static int no_delay(int fd) {
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* fails harmlessly on a non-TCP socket */
    }
    return fd;
}

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    static int (*real)(int, struct sockaddr *, socklen_t *, int);
    if (!real) real = (int (*)(int, struct sockaddr *, socklen_t *, int))dlsym(RTLD_NEXT, "accept4");
    return no_delay(real(fd, addr, len, flags));
}

int accept(int fd, struct sockaddr *addr, socklen_t *len) {
    static int (*real)(int, struct sockaddr *, socklen_t *);
    if (!real) real = (int (*)(int, struct sockaddr *, socklen_t *))dlsym(RTLD_NEXT, "accept");
    return no_delay(real(fd, addr, len));
}
