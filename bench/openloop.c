/* openloop: an open-loop HTTP/1.1 load generator (bench/openloop.py builds and drives it).
 *
 * Requests arrive on a Poisson schedule fixed by a seed (exponential gaps at --rate for
 * --duration-s), each carrying the next line of --bodies as its JSON body, and go out over a
 * pool of at most --connections keep-alive connections to 127.0.0.1 (epoll). A request whose
 * time has come but that finds no idle connection waits in this process, in schedule order.
 *
 * Invariant: every latency is measured from the request's *scheduled* send time, never from
 * when it actually went out, so time spent waiting for a connection (or for a late loop
 * wake-up) counts against the server as a real client would see it (no coordinated omission).
 *
 * Output: one JSON object on stdout; with --latencies FILE, one line per request
 * "index scheduled_s sent_s done_s status" (times from the start of the schedule; done_s and
 * sent_s are -1 for a request never answered, status 0 for a socket error or timeout).
 * --schedule-only prints the scheduled times (seconds, one per line) and exits.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    int port, connections;
    double rate, duration_s, timeout_s;
    uint64_t seed;
    const char *host, *path, *bodies, *latencies;
    int schedule_only;
} Args;

typedef struct {  /* one request: its times (s from t0; -1 = not yet) and status */
    double sched_s, sent_s, done_s;
    int status;
} Req;

typedef struct {  /* one connection: at most one request in flight */
    int fd, req;            /* req: index in flight, -1 when idle */
    char *out; size_t out_len, out_off;
    char *in; size_t in_len, in_cap;
    size_t head_len;        /* bytes of the status line and headers, 0 until complete */
    long content_length;    /* -1: none given */
    int chunked, close_after;
    size_t chunk_pos;       /* chunked: where the next chunk-size line starts */
} Conn;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what) {
    fprintf(stderr, "openloop: %s: %s\n", what, errno ? strerror(errno) : "invalid");
    exit(2);
}

/* splitmix64: the same schedule from the same seed on every machine (no libc rand) */
static uint64_t next_u64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static Req *schedule(const Args *a, int *n) {
    uint64_t s = a->seed;
    int cap = 1024, k = 0;
    Req *r = malloc(cap * sizeof *r);
    for (double t = 0;;) {
        double u = (next_u64(&s) >> 11) * 0x1.0p-53;  /* uniform in [0, 1) */
        t += -log1p(-u) / a->rate;
        if (t >= a->duration_s) break;
        if (k == cap) r = realloc(r, (cap *= 2) * sizeof *r);
        r[k++] = (Req){t, -1, -1, 0};
    }
    *n = k;
    return r;
}

static char **read_lines(const char *path, int *n) {
    FILE *f = fopen(path, "r");
    if (!f) die(path);
    int cap = 1024, k = 0;
    char **lines = malloc(cap * sizeof *lines), *line = NULL;
    size_t sz = 0;
    ssize_t len;
    while ((len = getline(&line, &sz, f)) >= 0) {
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (!len) continue;
        if (k == cap) lines = realloc(lines, (cap *= 2) * sizeof *lines);
        lines[k++] = strdup(line);
    }
    free(line);
    fclose(f);
    if (!k) { errno = 0; die("--bodies holds no line"); }
    *n = k;
    return lines;
}

static int open_conn(const Args *a) {
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(a->port)};
    if (inet_pton(AF_INET, a->host, &sa.sin_addr) != 1) { errno = 0; die("--host (IPv4)"); }
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) return -1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

/* How far the response in c->in is: 1 complete, 0 need more, -1 malformed. */
static int parse(Conn *c) {
    if (!c->head_len) {
        char *end = memmem(c->in, c->in_len, "\r\n\r\n", 4);
        if (!end) return 0;
        c->head_len = end - c->in + 4;
        c->content_length = -1;
        c->chunked = c->close_after = 0;
        c->chunk_pos = c->head_len;
        for (char *l = strstr(c->in, "\r\n"); l && l < end; l = strstr(l + 2, "\r\n")) {
            char *h = l + 2;
            if (!strncasecmp(h, "content-length:", 15)) c->content_length = atol(h + 15);
            else if (!strncasecmp(h, "transfer-encoding:", 18) && strcasestr(h, "chunked")
                     && strcasestr(h, "chunked") < strstr(h, "\r\n")) c->chunked = 1;
            else if (!strncasecmp(h, "connection:", 11) && strcasestr(h, "close")
                     && strcasestr(h, "close") < strstr(h, "\r\n")) c->close_after = 1;
        }
    }
    if (c->chunked) {
        for (;;) {
            char *line = c->in + c->chunk_pos;
            char *eol = memmem(line, c->in_len - c->chunk_pos, "\r\n", 2);
            if (!eol) return 0;
            char *hex_end;
            long size = strtol(line, &hex_end, 16);
            if (hex_end == line || size < 0) return -1;
            if (size == 0) {  /* last chunk: then trailers, ended by an empty line */
                size_t after = eol + 2 - c->in;
                if (c->in_len - after >= 2 && !memcmp(c->in + after, "\r\n", 2)) return 1;
                return memmem(c->in + after, c->in_len - after, "\r\n\r\n", 4) ? 1 : 0;
            }
            size_t next = (eol + 2 - c->in) + size + 2;
            if (c->in_len < next) return 0;
            c->chunk_pos = next;
        }
    }
    if (c->content_length >= 0) return c->in_len >= c->head_len + (size_t)c->content_length;
    return 0;  /* neither: the body ends when the server closes (see on_readable) */
}

typedef struct {
    const Args *a;
    Req *reqs; int n;
    char **bodies; int n_bodies;
    Conn *conns; int n_conns;
    int epfd, next_send, outstanding, errors;
    double t0;
} Run;

static void finish(Run *r, Conn *c, int status) {
    Req *q = &r->reqs[c->req];
    q->status = status;
    q->done_s = status ? now_s() - r->t0 : -1;
    if (!status) r->errors++;
    c->req = -1;
    c->in_len = c->head_len = 0;
    r->outstanding--;
}

static void drop(Run *r, Conn *c) {  /* a broken or closed connection: reopened on demand */
    if (c->req >= 0) finish(r, c, 0);
    epoll_ctl(r->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
    c->in_len = c->head_len = 0;
}

static int flush_out(Run *r, Conn *c) {  /* 0: all written or would block; -1: broken */
    while (c->out_off < c->out_len) {
        ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (w < 0 && (errno == EAGAIN || errno == EINTR)) break;
        if (w <= 0) return -1;
        c->out_off += w;
    }
    struct epoll_event ev = {.events = EPOLLIN | (c->out_off < c->out_len ? EPOLLOUT : 0),
                             .data.ptr = c};
    epoll_ctl(r->epfd, EPOLL_CTL_MOD, c->fd, &ev);
    return 0;
}

static void send_req(Run *r, Conn *c, int i) {
    const char *body = r->bodies[i % r->n_bodies];
    size_t blen = strlen(body);
    free(c->out);
    c->out_len = asprintf(&c->out, "POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: "
                          "application/json\r\nContent-Length: %zu\r\n\r\n%s", r->a->path,
                          r->a->host, r->a->port, blen, body);
    c->out_off = 0;
    c->req = i;
    r->reqs[i].sent_s = now_s() - r->t0;
    r->outstanding++;
    if (flush_out(r, c) < 0) drop(r, c);
}

static Conn *idle_conn(Run *r) {
    for (int k = 0; k < r->n_conns; k++) {
        Conn *c = &r->conns[k];
        if (c->fd >= 0 && c->req < 0) return c;
    }
    for (int k = 0; k < r->n_conns; k++) {  /* one that broke: reopen it */
        Conn *c = &r->conns[k];
        if (c->fd < 0) {
            if ((c->fd = open_conn(r->a)) < 0) { r->errors++; return NULL; }
            struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
            epoll_ctl(r->epfd, EPOLL_CTL_ADD, c->fd, &ev);
            return c;
        }
    }
    return NULL;
}

static void on_readable(Run *r, Conn *c) {
    for (;;) {
        if (c->in_cap - c->in_len < 4096) c->in = realloc(c->in, c->in_cap = c->in_cap * 2 + 8192);
        ssize_t got = read(c->fd, c->in + c->in_len, c->in_cap - c->in_len - 1);
        if (got < 0 && (errno == EAGAIN || errno == EINTR)) return;
        if (got <= 0) {  /* closed: ends a body of unstated length, else an error */
            if (c->req >= 0 && c->head_len && c->content_length < 0 && !c->chunked)
                finish(r, c, atoi(c->in + 9));
            drop(r, c);
            return;
        }
        c->in_len += got;
        c->in[c->in_len] = 0;
        if (c->req < 0) { drop(r, c); return; }  /* bytes nobody asked for */
        int done = parse(c);
        if (done < 0 || (c->head_len && strncmp(c->in, "HTTP/1.", 7))) { drop(r, c); return; }
        if (done) {
            int close_after = c->close_after;
            finish(r, c, atoi(c->in + 9));
            if (close_after) { drop(r, c); return; }
        }
    }
}

static void loop(Run *r) {
    struct epoll_event evs[256];
    double deadline = (r->n ? r->reqs[r->n - 1].sched_s : 0) + r->a->timeout_s;
    while (r->next_send < r->n || r->outstanding) {
        double t = now_s() - r->t0;
        if (t > deadline && r->next_send >= r->n) break;
        while (r->next_send < r->n && r->reqs[r->next_send].sched_s <= t) {
            Conn *c = idle_conn(r);
            if (!c) break;  /* every connection busy: it waits here, its latency running */
            send_req(r, c, r->next_send++);
        }
        int wait_ms = 100;
        if (r->next_send < r->n) {
            double until = r->reqs[r->next_send].sched_s - (now_s() - r->t0);
            wait_ms = until <= 0 ? (idle_conn(r) ? 0 : 100) : (int)ceil(until * 1e3);
        }
        int k = epoll_wait(r->epfd, evs, 256, wait_ms);
        for (int e = 0; e < k; e++) {
            Conn *c = evs[e].data.ptr;
            if (c->fd < 0) continue;
            if (evs[e].events & EPOLLOUT && flush_out(r, c) < 0) { drop(r, c); continue; }
            if (evs[e].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) on_readable(r, c);
        }
    }
    for (int k = 0; k < r->n_conns; k++)  /* what is still in flight timed out */
        if (r->conns[k].fd >= 0) drop(r, &r->conns[k]);
}

static int cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

static double pct(const double *sorted, int n, double p) {  /* nearest rank */
    if (!n) return NAN;
    int k = (int)ceil(p / 100 * n) - 1;
    return sorted[k < 0 ? 0 : k >= n ? n - 1 : k];
}

static void report(const Run *r, double wall_s) {
    double *lat = malloc((r->n + 1) * sizeof *lat), sum = 0, last = 0, lag = 0;
    int n = 0, cls[6] = {0};
    for (int i = 0; i < r->n; i++) {
        const Req *q = &r->reqs[i];
        if (q->sent_s >= 0 && q->sent_s - q->sched_s > lag) lag = q->sent_s - q->sched_s;
        if (q->status <= 0) { cls[0]++; continue; }
        cls[q->status / 100 < 6 ? q->status / 100 : 5]++;
        lat[n++] = (q->done_s - q->sched_s) * 1e3;
        sum += lat[n - 1];
        if (q->done_s > last) last = q->done_s;
    }
    qsort(lat, n, sizeof *lat, cmp_double);
    printf("{\"scheduled\": %d, \"completed\": %d, \"errors\": %d, \"offered_rps\": %.3f, "
           "\"achieved_rps\": %.3f, \"wall_s\": %.3f, \"max_send_lag_ms\": %.3f, "
           "\"status\": {\"1xx\": %d, \"2xx\": %d, \"3xx\": %d, \"4xx\": %d, \"5xx\": %d, "
           "\"error\": %d}, \"mean_ms\": %.3f, \"p50_ms\": %.3f, \"p90_ms\": %.3f, "
           "\"p99_ms\": %.3f, \"p999_ms\": %.3f, \"max_ms\": %.3f}\n",
           r->n, n, r->errors, r->n / r->a->duration_s, last > 0 ? n / last : 0.0, wall_s,
           lag * 1e3, cls[1], cls[2], cls[3], cls[4], cls[5], cls[0], n ? sum / n : 0.0,
           pct(lat, n, 50), pct(lat, n, 90), pct(lat, n, 99), pct(lat, n, 99.9),
           n ? lat[n - 1] : 0.0);
    free(lat);
}

static Args parse_args(int argc, char **argv) {
    Args a = {.port = 0, .connections = 64, .rate = 0, .duration_s = 0, .timeout_s = 60,
              .seed = 1, .host = "127.0.0.1", .path = "/v1/embeddings"};
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(k, "--schedule-only")) { a.schedule_only = 1; continue; }
        if (!v) { fprintf(stderr, "openloop: %s needs a value\n", k); exit(2); }
        i++;
        char *end = "";  /* a number's unparsed rest: must be empty */
        if (!strcmp(k, "--host")) a.host = v;
        else if (!strcmp(k, "--path")) a.path = v;
        else if (!strcmp(k, "--bodies")) a.bodies = v;
        else if (!strcmp(k, "--latencies")) a.latencies = v;
        else if (!strcmp(k, "--port")) a.port = strtol(v, &end, 10);
        else if (!strcmp(k, "--connections")) a.connections = strtol(v, &end, 10);
        else if (!strcmp(k, "--rate")) a.rate = strtod(v, &end);
        else if (!strcmp(k, "--duration-s")) a.duration_s = strtod(v, &end);
        else if (!strcmp(k, "--timeout-s")) a.timeout_s = strtod(v, &end);
        else if (!strcmp(k, "--seed")) a.seed = strtoull(v, &end, 10);
        else { fprintf(stderr, "openloop: unknown option %s\n", k); exit(2); }
        if (*end || end == v) {
            fprintf(stderr, "openloop: %s: not a number: %s\n", k, v);
            exit(2);
        }
    }
    const char *bad = !(a.rate > 0) ? "--rate must be > 0" : !(a.duration_s > 0)
        ? "--duration-s must be > 0" : a.schedule_only ? NULL : a.port <= 0 || a.port > 65535
        ? "--port must be 1-65535" : a.connections < 1 ? "--connections must be >= 1"
        : !(a.timeout_s > 0) ? "--timeout-s must be > 0" : !a.bodies ? "--bodies is required"
        : NULL;
    if (bad) { fprintf(stderr, "openloop: %s\n", bad); exit(2); }
    return a;
}

int main(int argc, char **argv) {
    Args a = parse_args(argc, argv);
    Run r = {.a = &a};
    r.reqs = schedule(&a, &r.n);
    if (a.schedule_only) {
        for (int i = 0; i < r.n; i++) printf("%.9f\n", r.reqs[i].sched_s);
        return 0;
    }
    r.bodies = read_lines(a.bodies, &r.n_bodies);
    r.epfd = epoll_create1(0);
    r.n_conns = a.connections;
    r.conns = calloc(r.n_conns, sizeof *r.conns);
    for (int k = 0; k < r.n_conns; k++) {  /* all opened before the clock starts */
        Conn *c = &r.conns[k];
        c->req = -1;
        if ((c->fd = open_conn(&a)) < 0) die("connect");
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(r.epfd, EPOLL_CTL_ADD, c->fd, &ev);
    }
    r.t0 = now_s();
    loop(&r);
    report(&r, now_s() - r.t0);
    if (a.latencies) {
        FILE *f = fopen(a.latencies, "w");
        if (!f) die(a.latencies);
        for (int i = 0; i < r.n; i++)
            fprintf(f, "%d %.9f %.9f %.9f %d\n", i, r.reqs[i].sched_s, r.reqs[i].sent_s,
                    r.reqs[i].status > 0 ? r.reqs[i].done_s : -1.0, r.reqs[i].status);
        fclose(f);
    }
    return 0;
}
