#include "mb.h"
/* Temporary stand-in until bindings/httpd.c lands; deleted with it. */
int luaopen_moonbox_httpd(lua_State *L)
{
    lua_newtable(L);
    return 1;
}
