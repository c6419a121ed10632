#pragma once
/* The CPUs' topology as Linux describes it (topology.c): which logical CPUs share a physical core. */

#include <sched.h>

/* Physical cores among the logical CPUs of `mask`: the distinct (package, core) pairs of
 * /sys/devices/system/cpu/cpuN/topology/{physical_package_id,core_id}. SMT siblings (hyperthreads) share
 * a core's execution units and its load ports, so a memory-bound decode gains nothing from the second one.
 * A CPU whose topology cannot be read counts as a core of its own. $BASERT_REF_SYSFS_ROOT prefixes the
 * sysfs path (tests point it at a fake tree). */
int rt_physical_cores(const cpu_set_t *mask);
