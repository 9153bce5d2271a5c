/*
 * misbehaving_server.c — a loopback peer that breaks HTTP on purpose, so the client's error
 * paths meet real sockets (not a mock of moonbox: a server that cannot be built from a correct
 * HTTP library). It listens on 127.0.0.1, prints its port on stdout, and answers each
 * connection in a child process according to the request path:
 *
 *   /reset      headers with Content-Length 100000, 1000 body bytes, then an RST (SO_LINGER 0)
 *   /close      closes the connection without a reply
 *   /malformed  replies with bytes that are not HTTP
 *   /hang       reads the request and never answers (until killed)
 *   /trickle    a valid 200 whose 10-byte body arrives one byte per 300 ms
 *   anything else  a valid "200 ok"
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static void send_all(int fd, const char *s, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, s, n);
        if (w <= 0) return;
        s += w;
        n -= (size_t)w;
    }
}

static void serve(int fd)
{
    char req[4096];
    size_t got = 0;
    while (got < sizeof req - 1) { /* read up to the end of the headers */
        ssize_t r = read(fd, req + got, sizeof req - 1 - got);
        if (r <= 0) break;
        got += (size_t)r;
        req[got] = '\0';
        if (strstr(req, "\r\n\r\n")) break;
    }
    req[got] = '\0';
    char path[256] = "/";
    sscanf(req, "%*s %255s", path);
    if (strcmp(path, "/reset") == 0) {
        const char *h = "HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n";
        send_all(fd, h, strlen(h));
        char body[1000];
        memset(body, 'x', sizeof body);
        send_all(fd, body, sizeof body);
        usleep(50 * 1000);
        struct linger lg = {1, 0};
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    } else if (strcmp(path, "/close") == 0) {
        /* nothing */
    } else if (strcmp(path, "/malformed") == 0) {
        const char *g = "THIS IS NOT HTTP AT ALL\r\n\r\n";
        send_all(fd, g, strlen(g));
        usleep(50 * 1000);
    } else if (strcmp(path, "/hang") == 0) {
        for (;;)
            pause();
    } else if (strcmp(path, "/trickle") == 0) {
        const char *h = "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n";
        send_all(fd, h, strlen(h));
        for (int i = 0; i < 10; i++) {
            usleep(300 * 1000);
            send_all(fd, "t", 1);
        }
    } else {
        const char *ok = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
        send_all(fd, ok, strlen(ok));
    }
    close(fd);
}

int main(void)
{
    signal(SIGCHLD, SIG_IGN); /* children reap themselves */
    int s = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(s, (struct sockaddr *)&a, sizeof a) < 0 || listen(s, 128) < 0) {
        perror("misbehaving_server");
        return 1;
    }
    socklen_t len = sizeof a;
    getsockname(s, (struct sockaddr *)&a, &len);
    printf("%d\n", ntohs(a.sin_port));
    fflush(stdout);
    for (;;) {
        int c = accept(s, NULL, NULL);
        if (c < 0) continue;
        pid_t pid = fork();
        if (pid == 0) {
            close(s);
            serve(c);
            _exit(0);
        }
        close(c);
    }
}
