/* linkmap.c - the hard-link table of moonbox-sandbox's copies (see linkmap.h). */
#include "linkmap.h"

#include <stdlib.h>
#include <string.h>

static size_t slot_of(dev_t dev, ino_t ino, size_t cap)
{
    return ((size_t)ino * 31u + (size_t)dev) % cap;
}

const char *linkmap_find(const linkmap *m, const struct stat *st)
{
    if (!m->cap) return NULL;
    for (size_t h = slot_of(st->st_dev, st->st_ino, m->cap); m->slots[h].path; h = (h + 1) % m->cap)
        if (m->slots[h].dev == st->st_dev && m->slots[h].ino == st->st_ino) return m->slots[h].path;
    return NULL;
}

int linkmap_add(linkmap *m, const struct stat *st, const char *path)
{
    if (m->n * 2 >= m->cap) {
        size_t ncap = m->cap ? m->cap * 2 : 256;
        linkmap_slot *ns = calloc(ncap, sizeof *ns);
        if (!ns) return -1;
        for (size_t i = 0; i < m->cap; i++)
            if (m->slots[i].path) {
                size_t h = slot_of(m->slots[i].dev, m->slots[i].ino, ncap);
                while (ns[h].path)
                    h = (h + 1) % ncap;
                ns[h] = m->slots[i];
            }
        free(m->slots);
        m->slots = ns;
        m->cap = ncap;
    }
    size_t h = slot_of(st->st_dev, st->st_ino, m->cap);
    while (m->slots[h].path)
        h = (h + 1) % m->cap;
    if (!(m->slots[h].path = strdup(path))) return -1;
    m->slots[h].dev = st->st_dev;
    m->slots[h].ino = st->st_ino;
    m->n++;
    return 0;
}
