#pragma once
/* The limits the process's own cgroups set (cgroup.c): the smallest on the path from its cgroup up to
 * the root, cgroup v2 and v1 alike. $BASERT_REF_CGROUP_ROOT prefixes /proc/self/{cgroup,mountinfo} and
 * the cgroup mounts (tests point it at a fake tree). */

typedef enum { RT_CGROUP_CPUS, RT_CGROUP_MEMORY } rt_cgroup_resource;

/* CPUs (v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us, rounded up) or bytes (v2 memory.max,
 * v1 memory.limit_in_bytes); 0 when no level sets one or it cannot be read. */
long long rt_cgroup_limit(rt_cgroup_resource what);
