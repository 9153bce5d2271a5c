/*
 * luac_dump.c — the build's Lua compiler: `luac_dump SRC_ROOT OUT_ROOT FILE...` compiles each
 * SRC_ROOT/FILE (a Lua source) to OUT_ROOT/FILE with ".lua" replaced by ".luac", with the same
 * liblua the moonbox binary links, so the bytecode always matches the binary's Lua. Debug
 * information is kept: the chunk keeps its source name ("@SRC_ROOT/FILE"), so tracebacks and
 * error positions read exactly as when the source itself is loaded. The binary loads these
 * instead of parsing the sources (bindings/main.c, bytecode_searcher) while they are newer than
 * their source.
 */
#include <lauxlib.h>
#include <lua.h>

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

static int write_chunk(lua_State *L, const void *p, size_t sz, void *ud)
{
    (void)L;
    return fwrite(p, 1, sz, (FILE *)ud) == sz ? 0 : 1;
}

/* mkdir -p of the directories above path. */
static void make_parents(char *path)
{
    for (char *s = strchr(path + 1, '/'); s; s = strchr(s + 1, '/')) {
        *s = '\0';
        mkdir(path, 0755);
        *s = '/';
    }
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: luac_dump SRC_ROOT OUT_ROOT FILE...\n");
        return 2;
    }
    lua_State *L = luaL_newstate();
    for (int i = 3; i < argc; i++) {
        char src[4096], out[4096];
        snprintf(src, sizeof src, "%s/%s", argv[1], argv[i]);
        int n = snprintf(out, sizeof out, "%s/%s", argv[2], argv[i]);
        if (n < 4 || strcmp(out + n - 4, ".lua") != 0) {
            fprintf(stderr, "luac_dump: %s is not a .lua file\n", argv[i]);
            return 1;
        }
        snprintf(out + n, sizeof out - (size_t)n, "c");
        if (luaL_loadfile(L, src) != LUA_OK) {
            fprintf(stderr, "luac_dump: %s\n", lua_tostring(L, -1));
            return 1;
        }
        make_parents(out);
        FILE *f = fopen(out, "wb");
        if (!f) {
            fprintf(stderr, "luac_dump: %s: %s\n", out, strerror(errno));
            return 1;
        }
        int bad = lua_dump(L, write_chunk, f, 0);
        if (fclose(f) != 0 || bad) {
            fprintf(stderr, "luac_dump: writing %s failed\n", out);
            remove(out);
            return 1;
        }
        lua_pop(L, 1);
    }
    lua_close(L);
    return 0;
}
