/* pvisor-host-relay: the sandbox's only way to its model.
 *
 * Listens on 127.0.0.1:PORT inside a sandbox that has no network and forwards every connection to the
 * host's model gateway, a unix socket bind-mounted into the sandbox:  relay PORT SOCKET_PATH
 * Built static so it runs in any x86_64 Linux image (baked or injected). One process per connection.
 */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static int write_all(int fd, const char *buf, ssize_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, (size_t)len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        buf += n;
        len -= n;
    }
    return 0;
}

static void pump(int a, int b) {
    struct pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    int open_a = 1, open_b = 1;
    char buf[65536];
    while (open_a || open_b) {
        fds[0].fd = open_a ? a : -1;
        fds[1].fd = open_b ? b : -1;
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return;
        }
        for (int i = 0; i < 2; i++) {
            if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            int from = i == 0 ? a : b, to = i == 0 ? b : a;
            ssize_t n = read(from, buf, sizeof buf);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                shutdown(to, SHUT_WR);
                if (i == 0) open_a = 0; else open_b = 0;
                continue;
            }
            if (write_all(to, buf, n) < 0) return;
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s PORT SOCKET_PATH\n", argv[0]);
        return 2;
    }
    struct sockaddr_un target = {.sun_family = AF_UNIX};
    if (strlen(argv[2]) >= sizeof target.sun_path) {
        fprintf(stderr, "relay: socket path too long\n");
        return 2;
    }
    strcpy(target.sun_path, argv[2]);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((unsigned short)atoi(argv[1])),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (listener < 0 || bind(listener, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(listener, 128) < 0) {
        perror("relay: listen");
        return 1;
    }
    signal(SIGCHLD, SIG_IGN); /* children are reaped automatically */
    for (;;) {
        int client = accept(listener, NULL, NULL);
        if (client < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            perror("relay: accept");
            sleep(1);
            continue;
        }
        pid_t pid = fork();
        if (pid == 0) {
            close(listener);
            int upstream = socket(AF_UNIX, SOCK_STREAM, 0);
            if (upstream < 0 || connect(upstream, (struct sockaddr *)&target, sizeof target) < 0) {
                perror("relay: connect gateway");
                _exit(1);
            }
            pump(client, upstream);
            _exit(0);
        }
        close(client);
    }
}
