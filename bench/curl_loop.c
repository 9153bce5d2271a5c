/*
 * curl_loop.c — the floor: a minimal C libcurl client doing what the moonbox client does, with
 * nothing on top. `curl_loop seq N URL` makes N sequential GETs on one reused easy handle
 * (keep-alive); `curl_loop conc N URL` starts N GETs at once on one multi handle and drives them
 * with curl_multi_poll; `curl_loop conc64 N URL` keeps 64 GETs in flight on one multi handle
 * until N are done (a finished handle is re-added for the next request, the
 * connection cache sized to the 64). Bodies are counted and dropped. $BENCH_AUTH, when set, is sent
 * as an Authorization header (bench/run.sh uses it to call moonbox local's API).
 */
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t sink(char *p, size_t s, size_t n, void *ud)
{
    (void)p;
    *(size_t *)ud += s * n;
    return s * n;
}

/* A handle that GETs url, adding the body's size to *bytes, with the header lines hdrs (none when
 * NULL). */
static CURL *get_handle(const char *url, size_t *bytes, struct curl_slist *hdrs)
{
    CURL *e = curl_easy_init();
    curl_easy_setopt(e, CURLOPT_URL, url);
    if (hdrs) curl_easy_setopt(e, CURLOPT_HTTPHEADER, hdrs);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, sink);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, bytes);
    return e;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: curl_loop seq|conc|conc64 N URL\n");
        return 2;
    }
    long n = strtol(argv[2], NULL, 10);
    const char *url = argv[3];
    size_t bytes = 0;
    long ok = 0;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    struct curl_slist *hdrs = NULL;
    const char *auth = getenv("BENCH_AUTH");
    char line[512];
    if (auth && *auth) {
        snprintf(line, sizeof line, "Authorization: %s", auth);
        hdrs = curl_slist_append(NULL, line);
    }
    if (strcmp(argv[1], "seq") == 0) {
        CURL *e = get_handle(url, &bytes, hdrs);
        for (long i = 0; i < n; i++) {
            long code = 0;
            if (curl_easy_perform(e) == CURLE_OK &&
                curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &code) == CURLE_OK && code == 200)
                ok++;
        }
        curl_easy_cleanup(e);
    } else if (strcmp(argv[1], "conc64") == 0) {
        enum { INFLIGHT = 64 };
        CURLM *m = curl_multi_init();
        curl_multi_setopt(m, CURLMOPT_MAXCONNECTS, (long)INFLIGHT);
        long started = 0;
        for (; started < n && started < INFLIGHT; started++)
            curl_multi_add_handle(m, get_handle(url, &bytes, NULL));
        int running = 1;
        while (running) {
            curl_multi_perform(m, &running);
            CURLMsg *msg;
            int left;
            while ((msg = curl_multi_info_read(m, &left))) {
                if (msg->msg != CURLMSG_DONE) continue;
                CURL *e = msg->easy_handle;
                long code = 0;
                curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &code);
                if (msg->data.result == CURLE_OK && code == 200) ok++;
                curl_multi_remove_handle(m, e);
                if (started < n) {
                    started++;
                    curl_multi_add_handle(m, e); /* same options: a reuse, no reset needed */
                    running = 1;
                } else {
                    curl_easy_cleanup(e);
                }
            }
            if (running) curl_multi_poll(m, NULL, 0, 1000, NULL);
        }
        curl_multi_cleanup(m);
    } else {
        CURLM *m = curl_multi_init();
        for (long i = 0; i < n; i++)
            curl_multi_add_handle(m, get_handle(url, &bytes, NULL));
        int running = 1;
        while (running) {
            curl_multi_perform(m, &running);
            if (running) curl_multi_poll(m, NULL, 0, 1000, NULL);
            CURLMsg *msg;
            int left;
            while ((msg = curl_multi_info_read(m, &left))) {
                if (msg->msg != CURLMSG_DONE) continue;
                long code = 0;
                curl_easy_getinfo(msg->easy_handle, CURLINFO_RESPONSE_CODE, &code);
                if (msg->data.result == CURLE_OK && code == 200) ok++;
                curl_multi_remove_handle(m, msg->easy_handle);
                curl_easy_cleanup(msg->easy_handle);
            }
        }
        curl_multi_cleanup(m);
    }
    curl_slist_free_all(hdrs);
    printf("%ld ok of %ld, %zu bytes\n", ok, n, bytes);
    return ok == n ? 0 : 1;
}
