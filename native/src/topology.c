/* Physical cores of a CPU mask, from sysfs (topology.h). Each CPU's package and core id are read once per
 * call; a call costs two small file reads per CPU of the mask, made once when the thread pool is sized. */

#include "topology.h"

#include <stdio.h>
#include <stdlib.h>

enum { MAX_CPUS = CPU_SETSIZE };

/* An integer file of cpuN's topology directory; -1 when it cannot be read. */
static long topology_value(const char *root, int cpu, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/sys/devices/system/cpu/cpu%d/topology/%s", root, cpu, name);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    long v = -1;
    if (fscanf(f, "%ld", &v) != 1) v = -1;
    fclose(f);
    return v;
}

int rt_physical_cores(const cpu_set_t *mask) {
    const char *root = getenv("BASERT_REF_SYSFS_ROOT");
    if (!root) root = "";
    /* (package, core) of each CPU seen so far; a core is new when no earlier CPU of the mask shares it. */
    long (*seen)[2] = malloc(sizeof(long[2]) * (size_t)CPU_COUNT(mask));
    if (!seen) return CPU_COUNT(mask);
    int n_seen = 0, cores = 0;
    for (int cpu = 0; cpu < MAX_CPUS; cpu++) {
        if (!CPU_ISSET(cpu, mask)) continue;
        long pkg = topology_value(root, cpu, "physical_package_id"), core = topology_value(root, cpu, "core_id");
        if (pkg < 0 || core < 0) { /* unknown: a core of its own */
            cores++;
            continue;
        }
        int dup = 0;
        for (int i = 0; i < n_seen && !dup; i++) dup = seen[i][0] == pkg && seen[i][1] == core;
        if (dup) continue;
        seen[n_seen][0] = pkg;
        seen[n_seen][1] = core;
        n_seen++;
        cores++;
    }
    free(seen);
    return cores;
}
