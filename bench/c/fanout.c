/*
 * Fan-out client for bench/peers.py: one epoll process holding every subscriber
 * connection, and a paced publisher, for topicd's watch streams (SSE) and NATS core.
 *
 *   fanout sub sse  HOST PORT TOPIC   N OUTFILE
 *   fanout sub nats HOST PORT SUBJECT N OUTFILE
 *   fanout pub http HOST PORT TOPIC   RATE COUNT
 *   fanout pub nats HOST PORT SUBJECT RATE COUNT
 *
 * The publisher sends COUNT single records, record i at t0 + i / RATE (an absolute
 * schedule), each a 100-byte JSON string "~T<send ns>~<i>~xxx..." whose send time is read
 * from CLOCK_MONOTONIC just before the request is written. On HTTP it writes
 * `POST /v0/topics/TOPIC` {"records":[{"data":<string>}]} on one keep-alive connection
 * and waits for each answer; on NATS it writes `PUB SUBJECT 100` with the same 100 bytes
 * as the payload. It prints one JSON line: sent, errors, the ack p50/max (HTTP) and how
 * far behind its schedule it fell.
 *
 * The subscriber opens N connections: for sse, `POST /v0/watch` {"topics":{TOPIC:
 * {"tail":true}}} on one setup connection, then `GET /v0/watch/<wid>` on a connection of
 * its own, read until its `caught-up` frame; for nats, `CONNECT`, `SUB SUBJECT`, `PING`,
 * read until `PONG`. Then it prints "ready" and reads every connection under one epoll
 * loop, stamping CLOCK_MONOTONIC after each read. It undoes the chunked transfer coding
 * (sse), splits lines, answers NATS `PING`s, and finds every "~T<ns>~<i>~" marker in a
 * line: one delivery of record i, latency = read time - ns. It stops when its stdin
 * closes (or gets a line), writes "conn index latency_ns" lines to OUTFILE and prints one
 * JSON line of counters.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RECORD_BYTES 100 /* the JSON string, quotes included */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void die(const char *what) {
    fprintf(stderr, "fanout: %s: %s\n", what, errno ? strerror(errno) : "failed");
    exit(1);
}

static int connect_to(const char *host, int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) die("inet_pton");
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) die("connect");
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct timeval tv = {.tv_sec = 30};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

static void write_all(int fd, const char *buf, size_t n) {
    while (n) {
        ssize_t w = write(fd, buf, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            die("write");
        }
        buf += w;
        n -= (size_t)w;
    }
}

/* Read one HTTP/1.1 response (head + Content-Length body) from a blocking socket.
 * Returns the status; the body (NUL-terminated) goes to `body` (cap bytes). */
static int http_response(int fd, char *body, size_t cap) {
    static char buf[1 << 16];
    size_t len = 0;
    char *end = NULL;
    while (!end) {
        if (len == sizeof buf - 1) die("response head too long");
        ssize_t r = read(fd, buf + len, sizeof buf - 1 - len);
        if (r <= 0) die("read response head");
        len += (size_t)r;
        buf[len] = 0;
        end = strstr(buf, "\r\n\r\n");
    }
    int status = atoi(buf + 9);
    size_t head = (size_t)(end + 4 - buf);
    size_t clen = 0;
    for (char *p = buf; p < end; p++) {
        if (*p == '\n' && strncasecmp(p + 1, "content-length:", 15) == 0)
            clen = strtoul(p + 16, NULL, 10);
    }
    if (clen + head >= sizeof buf) die("response body too long");
    while (len < head + clen) {
        ssize_t r = read(fd, buf + len, head + clen - len);
        if (r <= 0) die("read response body");
        len += (size_t)r;
    }
    if (body) {
        size_t n = clen < cap - 1 ? clen : cap - 1;
        memcpy(body, buf + head, n);
        body[n] = 0;
    }
    return status;
}

/* ---------------------------------------------------------------------------------------
 * subscriber */

enum { HEAD, CHUNK_SIZE, CHUNK_DATA, BODY_PLAIN, DONE };

typedef struct {
    int fd;
    int id;
    int state;
    int chunked;
    size_t chunk_left;
    size_t size_acc;
    int size_digits;
    int size_ext;
    char *line;
    size_t line_len, line_cap;
    char head[8192];
    size_t head_len;
    int caught_up; /* sse: saw `event: caught-up`; nats: saw PONG */
    int closed;
} conn_t;

typedef struct {
    int32_t conn, idx;
    int64_t lat;
} sample_t;

static sample_t *samples;
static size_t n_samples, cap_samples;
static long bad_markers, lines, frames, pings, err_lines;
static int nats_mode;

static void add_sample(int conn, int idx, int64_t lat) {
    if (n_samples == cap_samples) {
        cap_samples = cap_samples ? cap_samples * 2 : 1 << 16;
        samples = realloc(samples, cap_samples * sizeof *samples);
        if (!samples) die("realloc");
    }
    samples[n_samples++] = (sample_t){conn, idx, lat};
}

static void on_line(conn_t *c, const char *s, size_t n, int64_t t) {
    lines++;
    if (nats_mode) {
        if (n >= 4 && memcmp(s, "PING", 4) == 0) {
            pings++;
            write_all(c->fd, "PONG\r\n", 6);
            return;
        }
        if (n >= 4 && memcmp(s, "PONG", 4) == 0) {
            c->caught_up = 1;
            return;
        }
        if (n >= 4 && memcmp(s, "-ERR", 4) == 0) {
            err_lines++;
            fprintf(stderr, "fanout: conn %d: %.*s\n", c->id, (int)n, s);
            return;
        }
    } else if (n >= 6 && memcmp(s, "event:", 6) == 0) {
        const char *e = s + 6;
        size_t m = n - 6;
        while (m && *e == ' ') e++, m--;
        if (m >= 9 && memcmp(e, "caught-up", 9) == 0) c->caught_up = 1;
        if (m >= 6 && memcmp(e, "record", 6) == 0) frames++;
        if (m >= 5 && memcmp(e, "error", 5) == 0) err_lines++;
        return;
    }
    const char *p = s, *end = s + n;
    while ((p = memmem(p, (size_t)(end - p), "~T", 2)) != NULL) {
        p += 2;
        char *q;
        long long ns = strtoll(p, &q, 10);
        if (q >= end || *q != '~') {
            bad_markers++;
            continue;
        }
        long idx = strtol(q + 1, &q, 10);
        if (q >= end || *q != '~') {
            bad_markers++;
            continue;
        }
        add_sample(c->id, (int)idx, t - ns);
        p = q;
    }
}

static void feed_lines(conn_t *c, const char *s, size_t n, int64_t t) {
    while (n) {
        const char *nl = memchr(s, '\n', n);
        size_t take = nl ? (size_t)(nl - s) : n;
        if (c->line_len == 0 && nl) {
            size_t m = take;
            if (m && s[m - 1] == '\r') m--;
            on_line(c, s, m, t);
        } else {
            if (c->line_len + take > c->line_cap) {
                c->line_cap = (c->line_len + take) * 2 + 256;
                c->line = realloc(c->line, c->line_cap);
                if (!c->line) die("realloc");
            }
            memcpy(c->line + c->line_len, s, take);
            c->line_len += take;
            if (nl) {
                size_t m = c->line_len;
                if (m && c->line[m - 1] == '\r') m--;
                on_line(c, c->line, m, t);
                c->line_len = 0;
            }
        }
        if (!nl) return;
        s += take + 1;
        n -= take + 1;
    }
}

static void feed(conn_t *c, const char *s, size_t n, int64_t t) {
    while (n) {
        switch (c->state) {
        case HEAD: {
            size_t take = n;
            if (c->head_len + take >= sizeof c->head) take = sizeof c->head - 1 - c->head_len;
            memcpy(c->head + c->head_len, s, take);
            c->head_len += take;
            c->head[c->head_len] = 0;
            char *end = strstr(c->head, "\r\n\r\n");
            if (!end) {
                if (c->head_len == sizeof c->head - 1) die("stream head too long");
                return;
            }
            if (strncmp(c->head + 9, "200", 3) != 0) {
                fprintf(stderr, "fanout: conn %d: %s\n", c->id, c->head);
                exit(1);
            }
            for (char *p = c->head; *p; p++) *p = (char)tolower((unsigned char)*p);
            c->chunked = strstr(c->head, "\r\ntransfer-encoding: chunked") != NULL;
            size_t used = (size_t)(end + 4 - c->head) - (c->head_len - take);
            s += used;
            n -= used;
            c->state = c->chunked ? CHUNK_SIZE : BODY_PLAIN;
            break;
        }
        case CHUNK_SIZE: {
            char ch = *s++;
            n--;
            if (ch == '\n') {
                if (c->size_digits) {
                    c->chunk_left = c->size_acc;
                    c->size_acc = 0;
                    c->size_digits = c->size_ext = 0;
                    c->state = c->chunk_left ? CHUNK_DATA : DONE;
                }
            } else if (ch == ';') {
                c->size_ext = 1;
            } else if (!c->size_ext && isxdigit((unsigned char)ch)) {
                c->size_acc = c->size_acc * 16 +
                              (size_t)(isdigit((unsigned char)ch) ? ch - '0' : (tolower(ch) - 'a' + 10));
                c->size_digits++;
            }
            break;
        }
        case CHUNK_DATA: {
            size_t take = n < c->chunk_left ? n : c->chunk_left;
            feed_lines(c, s, take, t);
            s += take;
            n -= take;
            c->chunk_left -= take;
            if (!c->chunk_left) c->state = CHUNK_SIZE; /* the CRLF after the data is skipped there */
            break;
        }
        case BODY_PLAIN:
            feed_lines(c, s, n, t);
            return;
        case DONE:
            return;
        }
    }
}

static int read_some(conn_t *c, char *buf, size_t cap) {
    ssize_t r = read(c->fd, buf, cap);
    if (r > 0) feed(c, buf, (size_t)r, now_ns());
    return (int)r;
}

static int sub_main(int argc, char **argv) {
    if (argc != 8) return 2;
    const char *kind = argv[2], *host = argv[3], *topic = argv[5], *outfile = argv[7];
    int port = atoi(argv[4]), n = atoi(argv[6]);
    nats_mode = strcmp(kind, "nats") == 0;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    conn_t *conns = calloc((size_t)n, sizeof *conns);
    if (!conns) die("calloc");
    static char buf[1 << 16];
    char req[1024], body[4096];
    int setup = nats_mode ? -1 : connect_to(host, port);
    for (int i = 0; i < n; i++) {
        conn_t *c = &conns[i];
        c->id = i;
        if (nats_mode) {
            c->fd = connect_to(host, port);
            c->state = BODY_PLAIN;
            int len = snprintf(req, sizeof req,
                               "CONNECT {\"verbose\":false,\"pedantic\":false,\"name\":\"sub%d\"}"
                               "\r\nSUB %s %d\r\nPING\r\n",
                               i, topic, i + 1);
            write_all(c->fd, req, (size_t)len);
        } else {
            int blen = snprintf(body, sizeof body,
                                "{\"topics\":{\"%s\":{\"tail\":true}},\"heartbeat_ms\":60000}", topic);
            int len = snprintf(req, sizeof req,
                               "POST /v0/watch HTTP/1.1\r\nHost: %s:%d\r\n"
                               "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
                               host, port, blen, body);
            write_all(setup, req, (size_t)len);
            int status = http_response(setup, body, sizeof body);
            char *w = strstr(body, "\"wid\":\"");
            if (status != 200 && status != 201) {
                fprintf(stderr, "fanout: POST /v0/watch: HTTP %d: %s\n", status, body);
                return 1;
            }
            if (!w) die("no wid in the POST /v0/watch answer");
            w += 7;
            char *q = strchr(w, '"');
            if (!q) die("bad wid");
            *q = 0;
            c->fd = connect_to(host, port);
            c->state = HEAD;
            len = snprintf(req, sizeof req,
                           "GET /v0/watch/%s HTTP/1.1\r\nHost: %s:%d\r\n"
                           "Accept: text/event-stream\r\n\r\n",
                           w, host, port);
            write_all(c->fd, req, (size_t)len);
        }
        while (!c->caught_up) {
            int r = read_some(c, buf, sizeof buf);
            if (r <= 0) die(nats_mode ? "waiting for PONG" : "waiting for caught-up");
        }
    }
    if (setup >= 0) close(setup);
    n_samples = 0; /* nothing is published before "ready" */
    int ep = epoll_create1(0);
    if (ep < 0) die("epoll_create1");
    for (int i = 0; i < n; i++) {
        fcntl(conns[i].fd, F_SETFL, fcntl(conns[i].fd, F_GETFL) | O_NONBLOCK);
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, conns[i].fd, &ev) < 0) die("epoll_ctl");
    }
    struct epoll_event sev = {.events = EPOLLIN, .data.u32 = (uint32_t)n};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, 0, &sev) < 0) die("epoll_ctl stdin");
    printf("ready\n");
    fflush(stdout);
    long closed = 0;
    struct epoll_event evs[256];
    int running = 1;
    while (running) {
        int k = epoll_wait(ep, evs, 256, 1000);
        if (k < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int j = 0; j < k; j++) {
            uint32_t i = evs[j].data.u32;
            if (i == (uint32_t)n) {
                running = 0;
                continue;
            }
            conn_t *c = &conns[i];
            for (;;) {
                int r = read_some(c, buf, sizeof buf);
                if (r > 0) continue;
                if (r < 0 && (errno == EAGAIN || errno == EINTR)) break;
                if (!c->closed) {
                    c->closed = 1;
                    closed++;
                    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
                }
                break;
            }
        }
    }
    FILE *f = fopen(outfile, "w");
    if (!f) die("fopen");
    for (size_t i = 0; i < n_samples; i++)
        fprintf(f, "%d %d %lld\n", samples[i].conn, samples[i].idx, (long long)samples[i].lat);
    fclose(f);
    printf("{\"samples\":%zu,\"closed\":%ld,\"bad_markers\":%ld,\"frames\":%ld,\"pings\":%ld,"
           "\"error_lines\":%ld}\n",
           n_samples, closed, bad_markers, frames, pings, err_lines);
    fflush(stdout);
    for (int i = 0; i < n; i++) close(conns[i].fd);
    return 0;
}

/* ---------------------------------------------------------------------------------------
 * publisher */

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int pub_main(int argc, char **argv) {
    if (argc != 8) return 2;
    const char *kind = argv[2], *host = argv[3], *topic = argv[5];
    int port = atoi(argv[4]);
    double rate = atof(argv[6]);
    int count = atoi(argv[7]);
    int nats = strcmp(kind, "nats") == 0;
    int fd = connect_to(host, port);
    char buf[4096];
    if (nats) {
        ssize_t r = read(fd, buf, sizeof buf); /* INFO */
        if (r <= 0) die("read INFO");
        const char *hello = "CONNECT {\"verbose\":false,\"pedantic\":false,\"name\":\"pub\"}\r\nPING\r\n";
        write_all(fd, hello, strlen(hello));
        r = read(fd, buf, sizeof buf);
        if (r <= 0 || !memmem(buf, (size_t)r, "PONG", 4)) die("waiting for PONG");
    }
    int64_t *acks = calloc((size_t)count + 1, sizeof *acks);
    if (!acks) die("calloc");
    int errors = 0;
    int64_t behind_max = 0;
    int64_t t0 = now_ns() + 20000000LL;
    char rec[RECORD_BYTES + 1], req[1024];
    for (int i = 0; i < count; i++) {
        int64_t due = t0 + (int64_t)((double)i * 1e9 / rate);
        struct timespec ts = {.tv_sec = due / 1000000000LL, .tv_nsec = due % 1000000000LL};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
        }
        int64_t t = now_ns();
        if (t - due > behind_max) behind_max = t - due;
        /* the 100-byte JSON string: quotes, marker, padding */
        int m = snprintf(rec, sizeof rec, "\"~T%019lld~%d~", (long long)t, i);
        memset(rec + m, 'x', RECORD_BYTES - 1 - (size_t)m);
        rec[RECORD_BYTES - 1] = '"';
        rec[RECORD_BYTES] = 0;
        int len;
        if (nats) {
            /* the payload is the same 100 bytes as topicd's record data */
            len = snprintf(req, sizeof req, "PUB %s %d\r\n%s\r\n", topic, RECORD_BYTES, rec);
        } else {
            int blen = (int)strlen("{\"records\":[{\"data\":}]}") + RECORD_BYTES;
            len = snprintf(req, sizeof req,
                           "POST /v0/topics/%s HTTP/1.1\r\nHost: %s:%d\r\n"
                           "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                           "{\"records\":[{\"data\":%s}]}",
                           topic, host, port, blen, rec);
        }
        write_all(fd, req, (size_t)len);
        if (!nats) {
            int status = http_response(fd, buf, sizeof buf);
            acks[i] = now_ns() - t;
            if (status != 200 && status != 201) {
                if (!errors) fprintf(stderr, "fanout pub: HTTP %d: %s\n", status, buf);
                errors++;
            }
        }
    }
    if (nats) { /* everything written has reached the server once PONG comes back */
        write_all(fd, "PING\r\n", 6);
        ssize_t r;
        size_t got = 0;
        while ((r = read(fd, buf + got, sizeof buf - 1 - got)) > 0) {
            got += (size_t)r;
            buf[got] = 0;
            if (strstr(buf, "PONG")) break;
            if (got > sizeof buf / 2) got = 0;
        }
    }
    close(fd);
    double ack_p50 = 0, ack_max = 0;
    if (!nats && count) {
        qsort(acks, (size_t)count, sizeof *acks, cmp_i64);
        ack_p50 = (double)acks[(count - 1) / 2] / 1e6;
        ack_max = (double)acks[count - 1] / 1e6;
    }
    printf("{\"sent\":%d,\"errors\":%d,\"ack_p50_ms\":%.4f,\"ack_max_ms\":%.4f,"
           "\"behind_max_ms\":%.4f}\n",
           count, errors, ack_p50, ack_max, (double)behind_max / 1e6);
    return errors ? 1 : 0;
}

int main(int argc, char **argv) {
    int rc = 2;
    if (argc >= 2 && strcmp(argv[1], "sub") == 0) rc = sub_main(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "pub") == 0) rc = pub_main(argc, argv);
    if (rc == 2)
        fprintf(stderr, "usage: fanout sub sse|nats HOST PORT TOPIC N OUTFILE\n"
                        "       fanout pub http|nats HOST PORT TOPIC RATE COUNT\n");
    return rc;
}
