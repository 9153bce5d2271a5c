/* archive_fs.c - the small filesystem helpers the archive workers share (see archive_fs.h).
 *
 * Walks hold no DIR stream across recursion (names are read into sorted arrays first), so
 * archives come out in a stable order and only one descriptor per level is open.
 */
#include "archive_fs.h"

#include "host_fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Splits path into a malloc'd directory ("." when there is none) and a pointer to its last
 * component inside *dir's allocation's twin *base (also malloc'd). Trailing slashes are
 * ignored; "/" gives ("/", ""). Returns 0, or -1 without memory. */
int archive_fs_split_path(const char *path, char **dir, char **base)
{
    size_t len = strlen(path);
    while (len > 1 && path[len - 1] == '/')
        len--;
    size_t cut = len;
    while (cut > 0 && path[cut - 1] != '/')
        cut--;
    *base = strndup(path + cut, len - cut);
    if (cut == 0)
        *dir = strdup(".");
    else if (cut == 1)
        *dir = strdup("/");
    else
        *dir = strndup(path, cut - 1);
    if (!*dir || !*base) {
        free(*dir);
        free(*base);
        *dir = *base = NULL;
        return -1;
    }
    if (len == 1 && path[0] == '/') (*base)[0] = '\0';
    return 0;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

void archive_fs_free_names(char **names, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
}

/* Reads the names in the directory open as dirfd (except . and ..) into a sorted array, so a
 * walk never holds a DIR stream across recursion and archives come out in a stable order.
 * Returns 0, or -1 with errno set. dirfd stays open and is not moved. */
int archive_fs_read_names(int dirfd, char ***out, size_t *nout)
{
    int fd = openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -1;
    DIR *d = fdopendir(fd);
    if (!d) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    errno = 0;
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        if (n == cap) {
            size_t ncap = cap ? cap * 2 : 32;
            char **grown = (char **)realloc(names, ncap * sizeof *names);
            if (!grown) goto nomem;
            names = grown;
            cap = ncap;
        }
        if (!(names[n] = strdup(de->d_name))) goto nomem;
        n++;
        errno = 0;
    }
    if (errno != 0) {
        int e = errno;
        closedir(d);
        archive_fs_free_names(names, n);
        errno = e;
        return -1;
    }
    closedir(d);
    if (n > 1) qsort(names, n, sizeof *names, cmp_names);
    *out = names;
    *nout = n;
    return 0;
nomem:
    closedir(d);
    archive_fs_free_names(names, n);
    errno = ENOMEM;
    return -1;
}

/* Joins prefix and name (prefix empty or ending in '/') into a new string. */
char *archive_fs_join_rel(const char *prefix, const char *name, const char *suffix)
{
    size_t a = strlen(prefix), b = strlen(name), c = strlen(suffix);
    char *s = (char *)malloc(a + b + c + 1);
    if (!s) return NULL;
    memcpy(s, prefix, a);
    memcpy(s + a, name, b);
    memcpy(s + a + b, suffix, c + 1);
    return s;
}

/* Removes the entry `name` of the directory dirfd, whatever it is (runtime/host_fs.c's one
 * tree removal, opening up directory modes that came from an archive). */
void archive_fs_remove_entry(int dirfd, const char *name)
{
    host_fs_remove_tree(dirfd, name, HOST_FS_OPEN_MODES, NULL, 0);
}

/* Writes all of buf at offset off of fd. Returns 0 or -1 with errno. */
int archive_fs_pwrite_all(int fd, const char *buf, size_t len, off_t off)
{
    while (len > 0) {
        ssize_t n = pwrite(fd, buf, len, off);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        buf += n;
        len -= (size_t)n;
        off += n;
    }
    return 0;
}
