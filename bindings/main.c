/*
 * main.c — the moonbox executable: one Lua 5.4 state with moonbox's C modules preloaded and its
 * Lua library on package.path; everything else (commands, help, exit codes) is
 * lua/moonbox/cli.lua. After the command returns, the runtime is shut down and the registry-ref
 * leak check runs before lua_close.
 */
#include "mb.h"

#include <lualib.h>

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef MOONBOX_SOURCE_LUA_DIR
#define MOONBOX_SOURCE_LUA_DIR ""
#endif
#ifndef MOONBOX_INSTALL_LUA_REL
#define MOONBOX_INSTALL_LUA_REL "../share/moonbox/lua"
#endif
#ifndef MOONBOX_BUILD_CMOD_DIR
#define MOONBOX_BUILD_CMOD_DIR ""
#endif
#ifndef MOONBOX_INSTALL_CMOD_REL
#define MOONBOX_INSTALL_CMOD_REL "../lib/moonbox/exe"
#endif
#ifndef MOONBOX_BUILD_LUAC_DIR
#define MOONBOX_BUILD_LUAC_DIR ""
#endif

/* Where the bytecode of the source tree's Lua library is (see bytecode_searcher), "" if none. */
static char g_luadir[PATH_MAX];

static int newer_or_same(const struct stat *a, const struct stat *b)
{
    if (a->st_mtim.tv_sec != b->st_mtim.tv_sec) return a->st_mtim.tv_sec > b->st_mtim.tv_sec;
    return a->st_mtim.tv_nsec >= b->st_mtim.tv_nsec;
}

/* A package.searchers entry, before Lua's own file searcher: for moonbox.* modules of the source
 * tree this binary was built from, loads the build's precompiled bytecode (CMakeLists.txt,
 * moonbox-luac) instead of parsing the source, as long as the bytecode is at least as new as
 * the source (an edited source is parsed until the next build). The chunk keeps its source
 * name, so errors and tracebacks are the same as with the source; like Lua's searcher it passes
 * the source's path as the loader's second value. Anything else is left to the next searcher. */
static int bytecode_searcher(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    if (strncmp(name, "moonbox.", 8) != 0) {
        lua_pushliteral(L, "\n\tnot a moonbox module (no bytecode)");
        return 1;
    }
    char rel[512];
    size_t n = strlen(name);
    if (n >= sizeof rel - 16) return 0;
    for (size_t i = 0; i <= n; i++)
        rel[i] = name[i] == '.' ? '/' : name[i];
    static const char *const forms[] = {"%s/%s.lua", "%s/%s/init.lua"};
    for (int k = 0; k < 2; k++) {
        char src[PATH_MAX + 600], bc[PATH_MAX + 600];
        struct stat ss, bs;
        snprintf(src, sizeof src, forms[k], g_luadir, rel);
        if (stat(src, &ss) != 0) continue;
        snprintf(bc, sizeof bc, forms[k], MOONBOX_BUILD_LUAC_DIR, rel);
        strncat(bc, "c", sizeof bc - strlen(bc) - 1);
        if (stat(bc, &bs) != 0 || !newer_or_same(&bs, &ss)) break;
        if (luaL_loadfilex(L, bc, "b") != LUA_OK) {
            lua_pop(L, 1);
            break;
        }
        lua_pushstring(L, src);
        return 2;
    }
    lua_pushliteral(L, "\n\tno current bytecode");
    return 1;
}

/* Puts bytecode_searcher second in package.searchers (after the preload searcher) when luadir is
 * the source tree this binary was built from and the build made bytecode. */
static void install_bytecode_searcher(lua_State *L, const char *luadir)
{
    if (!MOONBOX_BUILD_LUAC_DIR[0] || strcmp(luadir, MOONBOX_SOURCE_LUA_DIR) != 0) return;
    snprintf(g_luadir, sizeof g_luadir, "%s", luadir);
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "searchers");
    for (lua_Integer i = luaL_len(L, -1); i >= 2; i--) {
        lua_rawgeti(L, -1, i);
        lua_rawseti(L, -2, i + 1);
    }
    lua_pushcfunction(L, bytecode_searcher);
    lua_rawseti(L, -2, 2);
    lua_pop(L, 2);
}

static int has_library(const char *dir)
{
    char probe[PATH_MAX];
    struct stat st;
    if (snprintf(probe, sizeof probe, "%s/moonbox/cli.lua", dir) >= (int)sizeof probe) return 0;
    return stat(probe, &st) == 0;
}

/* Finds lua/: $MOONBOX_LUA_DIR, then the install tree next to the binary, then the source tree
 * the binary was built from. Returns 0 when none holds moonbox/cli.lua. */
static int find_lua_dir(char *out, size_t len, char *exe, size_t exelen)
{
    const char *env = getenv("MOONBOX_LUA_DIR");
    ssize_t n = readlink("/proc/self/exe", exe, exelen - 1);
    exe[n > 0 ? n : 0] = '\0';
    if (env && *env) {
        snprintf(out, len, "%s", env);
        return has_library(out);
    }
    if (n > 0) {
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%s", exe);
        char *slash = strrchr(dir, '/');
        if (slash) *slash = '\0';
        char cand[PATH_MAX + 64];
        snprintf(cand, sizeof cand, "%s/%s", dir, MOONBOX_INSTALL_LUA_REL);
        char real[PATH_MAX];
        if (realpath(cand, real) && has_library(real)) {
            snprintf(out, len, "%s", real);
            return 1;
        }
    }
    snprintf(out, len, "%s", MOONBOX_SOURCE_LUA_DIR);
    return has_library(out);
}

/* Many concurrent sockets are moonbox's normal case; the default soft limit of 1024 is not. */
static void raise_fd_limit(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

static int traceback_handler(lua_State *L)
{
    const char *msg = lua_tostring(L, 1);
    if (!msg) msg = luaL_tolstring(L, 1, NULL);
    luaL_traceback(L, L, msg, 1);
    return 1;
}

/* Overwrites the value of every --api-key KEY and --api-key=KEY in argv with NULs, once Lua
 * holds its copy: /proc/PID/cmdline, which every user of the host reads, then shows the flag
 * and no key (issue 23). Until this runs, right after exec, the key is visible; the flag's
 * documentation says so and points at --api-key-file and MOONBOX_LOCAL_API_KEY. */
static void wipe_secrets(int argc, char **argv)
{
    static const char flag[] = "--api-key";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], flag) == 0 && i + 1 < argc) {
            memset(argv[i + 1], 0, strlen(argv[i + 1]));
            i++;
        } else if (strncmp(argv[i], flag, sizeof flag - 1) == 0 &&
                   argv[i][sizeof flag - 1] == '=') {
            char *v = argv[i] + sizeof flag;
            memset(v, 0, strlen(v));
        }
    }
}

/* The moonbox binary: finds the Lua library (exit 2 with a hint if it cannot), makes the main
 * state (mb_main_state), puts the library and the C-module directory first on package.path and
 * package.cpath, installs the bytecode searcher and the moonbox.build facts table, then calls
 * require("moonbox.cli").main(argv) under a traceback handler; argv[0] is at index 0. Returns
 * that function's integer result as the exit status (0 for a non-integer), 1 if the CLI fails
 * to load or raises, and 3 instead of 0 when the registry-ref leak check is on
 * (moonbox.leakcheck or MOONBOX_LEAK_CHECK=1) and references are still held after
 * mb_runtime_shutdown. Errors go to stderr; the state is closed on every path after it exists. */
int main(int argc, char **argv)
{
    char luadir[PATH_MAX], exe[PATH_MAX];
    raise_fd_limit();
    if (!find_lua_dir(luadir, sizeof luadir, exe, sizeof exe)) {
        fprintf(stderr,
                "moonbox: cannot find its Lua library (looked in $MOONBOX_LUA_DIR, next to %s, "
                "and in %s); reinstall moonbox or set MOONBOX_LUA_DIR to the lua/ directory\n",
                exe, MOONBOX_SOURCE_LUA_DIR);
        return 2;
    }
    lua_State *L = mb_main_state();
    if (!L) {
        fprintf(stderr, "moonbox: out of memory creating the Lua state\n");
        return 1;
    }

    lua_getglobal(L, "package");
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;", luadir, luadir);
    lua_getfield(L, -2, "path");
    lua_concat(L, 2);
    lua_setfield(L, -2, "path");
    /* The binary's own C modules that are loaded on first require (moonbox.archive): next to
     * an installed binary, else in the build tree it came from. */
    char cmod[PATH_MAX + 64];
    char cmod_real[PATH_MAX];
    snprintf(cmod, sizeof cmod, "%s", exe);
    char *slash = strrchr(cmod, '/');
    if (slash) *slash = '\0';
    strncat(cmod, "/" MOONBOX_INSTALL_CMOD_REL, sizeof cmod - strlen(cmod) - 1);
    const char *cmod_dir = realpath(cmod, cmod_real) ? cmod_real : MOONBOX_BUILD_CMOD_DIR;
    lua_pushfstring(L, "%s/?.so;", cmod_dir);
    lua_getfield(L, -2, "cpath");
    lua_concat(L, 2);
    lua_setfield(L, -2, "cpath");
    lua_pop(L, 1);
    install_bytecode_searcher(L, luadir);

    /* moonbox.build: facts about this binary, for the CLI and the tests. */
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
    lua_createtable(L, 0, 4);
    mb_setfield_str(L, -1, "version", MB_VERSION);
    mb_setfield_str(L, -1, "lua_dir", luadir);
    mb_setfield_str(L, -1, "exe", exe);
#ifdef MOONBOX_SANITIZED
    mb_setfield_bool(L, -1, "sanitized", 1);
#endif
    lua_setfield(L, -2, "moonbox.build");
    lua_pop(L, 1);

    int code = 1;
    lua_pushcfunction(L, traceback_handler);
    lua_getglobal(L, "require");
    lua_pushstring(L, "moonbox.cli");
    if (lua_pcall(L, 1, 1, 1) != LUA_OK) {
        fprintf(stderr, "moonbox: cannot load the CLI: %s\n", lua_tostring(L, -1));
        lua_close(L);
        return 1;
    }
    lua_getfield(L, -1, "main");
    lua_createtable(L, argc, 0);
    for (int i = 0; i < argc; i++) {
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, i);
    }
    wipe_secrets(argc, argv);
    if (lua_pcall(L, 1, 1, 1) != LUA_OK) {
        fprintf(stderr, "moonbox: internal error: %s\n", lua_tostring(L, -1));
        code = 1;
    } else {
        code = lua_isinteger(L, -1) ? (int)lua_tointeger(L, -1) : 0;
    }
    lua_settop(L, 0);

    long leaked = mb_runtime_shutdown(L);
    lua_getfield(L, LUA_REGISTRYINDEX, "moonbox.leakcheck");
    int check = lua_toboolean(L, -1) ||
                (getenv("MOONBOX_LEAK_CHECK") && *getenv("MOONBOX_LEAK_CHECK") == '1');
    lua_pop(L, 1);
    if (leaked != 0) {
        fprintf(stderr, "moonbox: registry-ref leak check: %ld reference(s) still held at exit\n",
                leaked);
        if (check && code == 0) code = 3;
    } else if (check) {
        fprintf(stderr, "moonbox: registry-ref leak check: 0 references held at exit\n");
    }
    lua_close(L);
    return code;
}
