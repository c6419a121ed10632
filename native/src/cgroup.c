/* The limits a process's cgroups set (cgroup.h). The limit that applies is the
 * smallest one on the path from the process's own cgroup up to the hierarchy's
 * root, in cgroup v2 and in the v1 controller's hierarchy alike: CPUs from v2
 * `cpu.max` ("quota period" or "max period") and v1 cpu.cfs_quota_us /
 * cpu.cfs_period_us (-1 = none); memory from v2 `memory.max` ("max" or bytes)
 * and v1 memory.limit_in_bytes (a page-rounded LLONG_MAX = none). The process's
 * cgroup is read from /proc/self/cgroup and the hierarchies' mount points (and
 * mount roots, for a container that sees only part of the tree) from
 * /proc/self/mountinfo. $BASERT_REF_CGROUP_ROOT, when set, is prefixed to all
 * of these paths (tests point it at a fake tree). */

#include "cgroup.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { CG_PATH = 4096 };

/* ceil(quota / period) CPUs; 0 for no limit or an unreadable one. */
static long long quota_cpus(long long quota, long long period) {
    if (quota <= 0 || period <= 0) return 0;
    long long cpus = quota / period + (quota % period != 0);
    return cpus > 1024 ? 1024 : cpus;
}

static bool read_first_line(const char *path, char *buf, int n) {
    FILE *f = fopen(path, "r");
    if (!f) return false;
    bool ok = fgets(buf, n, f) != NULL;
    fclose(f);
    return ok;
}

static long long v2_cpus(const char *dir) {
    char path[CG_PATH + 16], line[128], quota[32];
    long long period = 0;
    snprintf(path, sizeof path, "%s/cpu.max", dir);
    if (!read_first_line(path, line, (int)sizeof line) || sscanf(line, "%31s %lld", quota, &period) != 2 ||
        strcmp(quota, "max") == 0)
        return 0;
    return quota_cpus(strtoll(quota, NULL, 10), period);
}

static long long v1_value(const char *dir, const char *name) {
    char path[CG_PATH + 32], line[64];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return read_first_line(path, line, (int)sizeof line) ? strtoll(line, NULL, 10) : -1;
}

static long long v1_cpus(const char *dir) {
    return quota_cpus(v1_value(dir, "cpu.cfs_quota_us"), v1_value(dir, "cpu.cfs_period_us"));
}

/* Bytes; 0 for no limit or an unreadable one. v1 says "none" with a huge page-rounded value. */
static long long memory_bytes(long long v) { return v > 0 && v < (1LL << 60) ? v : 0; }

static long long v2_memory(const char *dir) {
    char path[CG_PATH + 16], line[64];
    snprintf(path, sizeof path, "%s/memory.max", dir);
    if (!read_first_line(path, line, (int)sizeof line) || strncmp(line, "max", 3) == 0) return 0;
    return memory_bytes(strtoll(line, NULL, 10));
}

static long long v1_memory(const char *dir) { return memory_bytes(v1_value(dir, "memory.limit_in_bytes")); }

typedef long long (*level_limit)(const char *dir);

/* The smallest limit from dir up to its first stop_len characters (the
 * hierarchy's mount point); 0 when no level sets one. dir is consumed. */
static long long smallest_limit_up(char *dir, size_t stop_len, level_limit limit) {
    long long best = 0;
    for (;;) {
        long long l = limit(dir);
        if (l > 0 && (best == 0 || l < best)) best = l;
        char *slash = strrchr(dir, '/');
        if (strlen(dir) <= stop_len || !slash || (size_t)(slash - dir) < stop_len) break;
        *slash = '\0';
    }
    return best;
}

/* Is `word` one of the comma-separated items of list? */
static bool has_item(const char *list, const char *word) {
    size_t n = strlen(word);
    for (const char *p = list; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
        if (strncmp(p, word, n) == 0 && (p[n] == ',' || p[n] == '\0' || p[n] == '\n')) return true;
    return false;
}

typedef struct {
    bool found;
    char cgroup[CG_PATH]; /* the process's cgroup in this hierarchy */
    char mount[CG_PATH];  /* its mount point */
    char mroot[CG_PATH];  /* the part of the hierarchy mounted there */
} cg_hier;

/* The limit of one hierarchy: its levels from root + mount + (cgroup minus mroot) up to the mount. */
static long long hierarchy_limit(const char *root, const cg_hier *h, level_limit limit) {
    const char *rel = h->cgroup;
    size_t mr = strlen(h->mroot);
    if (strcmp(h->mroot, "/") != 0) /* a container's view: the cgroup path is under its mount root */
        rel = strncmp(rel, h->mroot, mr) == 0 && (rel[mr] == '/' || rel[mr] == '\0') ? rel + mr : "";
    char dir[3 * CG_PATH];
    int base = snprintf(dir, sizeof dir, "%s%s", root, strcmp(h->mount, "/") == 0 ? "" : h->mount);
    if (base < 0 || (size_t)base >= sizeof dir) return 0;
    int n = snprintf(dir + base, sizeof dir - (size_t)base, "%s", rel);
    if (n < 0 || (size_t)(base + n) >= sizeof dir) return 0;
    size_t len = strlen(dir);
    while (len > (size_t)base && dir[len - 1] == '/') dir[--len] = '\0';
    return smallest_limit_up(dir, (size_t)base, limit);
}

long long rt_cgroup_limit(rt_cgroup_resource what) {
    const char *controller = what == RT_CGROUP_CPUS ? "cpu" : "memory";
    const char *root = getenv("BASERT_REF_CGROUP_ROOT");
    if (!root) root = "";
    char path[CG_PATH + 32];
    cg_hier v2 = {0}, v1 = {0};
    snprintf(path, sizeof path, "%s/proc/self/cgroup", root);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2 || strlen(c2 + 1) >= CG_PATH) continue;
        *c1 = *c2 = '\0'; /* line: hierarchy id, c1 + 1: controllers, c2 + 1: path */
        cg_hier *h = strcmp(line, "0") == 0 && c1[1] == '\0' ? &v2 : has_item(c1 + 1, controller) ? &v1 : NULL;
        if (h) {
            h->found = true;
            strcpy(h->cgroup, c2 + 1);
        }
    }
    fclose(f);
    /* Mount points, by default where systemd and Docker put them. */
    strcpy(v2.mount, "/sys/fs/cgroup");
    snprintf(v1.mount, sizeof v1.mount, "/sys/fs/cgroup/%s", controller);
    strcpy(v2.mroot, "/");
    strcpy(v1.mroot, "/");
    snprintf(path, sizeof path, "%s/proc/self/mountinfo", root);
    if ((f = fopen(path, "r"))) {
        char mroot[CG_PATH], mount[CG_PATH], fstype[64], opts[1024];
        while (getline(&line, &cap, f) > 0) {
            const char *dash = strstr(line, " - ");
            if (!dash || sscanf(line, "%*s %*s %*s %4095s %4095s", mroot, mount) != 2 ||
                sscanf(dash + 3, "%63s %*s %1023s", fstype, opts) != 2)
                continue;
            cg_hier *h = strcmp(fstype, "cgroup2") == 0 ? &v2
                         : strcmp(fstype, "cgroup") == 0 && has_item(opts, controller) ? &v1
                                                                                   : NULL;
            if (h) {
                strcpy(h->mroot, mroot);
                strcpy(h->mount, mount);
            }
        }
        fclose(f);
    }
    free(line);
    bool cpus = what == RT_CGROUP_CPUS;
    long long a = v2.found ? hierarchy_limit(root, &v2, cpus ? v2_cpus : v2_memory) : 0;
    long long b = v1.found ? hierarchy_limit(root, &v1, cpus ? v1_cpus : v1_memory) : 0;
    return a && b ? (a < b ? a : b) : a ? a : b;
}

