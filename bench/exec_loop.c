/*
 * exec_loop.c — the floor for a no-op exec: N times, mint a run token (POST .../runs/stream/token
 * with {"command":"true"}) and run it (POST the token's uri, read the SSE stream to its end), on
 * one reused curl easy handle. `exec_loop N BASE_URL SANDBOX_ID API_KEY`. The token and uri are
 * picked out of the JSON with strstr: this is a benchmark floor, not a client.
 */
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct buf {
    char *p;
    size_t n;
} buf;

static size_t collect(char *d, size_t s, size_t n, void *ud)
{
    buf *b = (buf *)ud;
    char *q = realloc(b->p, b->n + s * n + 1);
    if (!q) return 0;
    b->p = q;
    memcpy(b->p + b->n, d, s * n);
    b->n += s * n;
    b->p[b->n] = 0;
    return s * n;
}

/* Copies the string value of "key":"..." from json into out. */
static int field(const char *json, const char *key, char *out, size_t len)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":\"", key);
    const char *s = strstr(json, pat);
    if (!s) return -1;
    s += strlen(pat);
    const char *e = strchr(s, '"');
    if (!e || (size_t)(e - s) >= len) return -1;
    memcpy(out, s, (size_t)(e - s));
    out[e - s] = 0;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: exec_loop N BASE_URL SANDBOX_ID API_KEY\n");
        return 2;
    }
    long n = strtol(argv[1], NULL, 10), ok = 0;
    char mint_url[512], auth[256], tok_auth[256], token[128], uri[512];
    snprintf(mint_url, sizeof mint_url, "%s/v1/sandboxes/%s/runs/stream/token", argv[2], argv[3]);
    snprintf(auth, sizeof auth, "Authorization: Bearer %s", argv[4]);
    const char *body = "{\"command\":\"true\"}";
    curl_global_init(CURL_GLOBAL_DEFAULT);
    CURL *e = curl_easy_init();
    for (long i = 0; i < n; i++) {
        buf b = {0};
        struct curl_slist *h = curl_slist_append(NULL, auth);
        h = curl_slist_append(h, "Content-Type: application/json");
        curl_easy_setopt(e, CURLOPT_URL, mint_url);
        curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, collect);
        curl_easy_setopt(e, CURLOPT_WRITEDATA, &b);
        int good = curl_easy_perform(e) == CURLE_OK && b.p &&
                   field(b.p, "token", token, sizeof token) == 0 &&
                   field(b.p, "uri", uri, sizeof uri) == 0;
        curl_slist_free_all(h);
        free(b.p);
        if (!good) continue;
        buf s = {0};
        snprintf(tok_auth, sizeof tok_auth, "Authorization: Bearer %s", token);
        h = curl_slist_append(NULL, tok_auth);
        h = curl_slist_append(h, "Accept: text/event-stream");
        h = curl_slist_append(h, "Content-Type: application/json");
        curl_easy_setopt(e, CURLOPT_URL, uri);
        curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
        curl_easy_setopt(e, CURLOPT_WRITEDATA, &s);
        if (curl_easy_perform(e) == CURLE_OK && s.p && strstr(s.p, "event: exit")) ok++;
        curl_slist_free_all(h);
        free(s.p);
    }
    curl_easy_cleanup(e);
    printf("%ld ok of %ld\n", ok, n);
    return ok == n ? 0 : 1;
}
