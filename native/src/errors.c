/* Thread-local error state and the reference engine's fault injection. */

#include "baseRT/reference.h"
#include "errors.h"

#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RT_ERROR_MAX 1024

static _Thread_local char g_error_msg[RT_ERROR_MAX];
static _Thread_local BaseRTErrorCode g_error_code = BASERT_OK;

void rt_set_error(BaseRTErrorCode code, const char *fmt, ...) {
    /* Format into a temporary: an argument may point into g_error_msg itself
     * (a caller re-wrapping the previous message). */
    char tmp[RT_ERROR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    memcpy(g_error_msg, tmp, sizeof tmp);
    g_error_code = code == BASERT_OK ? BASERT_ERR_UNKNOWN : code;
}

void rt_clear_error(void) {
    g_error_msg[0] = '\0';
    g_error_code = BASERT_OK;
}

BaseRTErrorCode rt_last_error_code(void) { return g_error_code; }

const char *baseRT_get_error(void) { return g_error_msg; }

BaseRTErrorCode baseRT_get_error_code(void) { return g_error_code; }

const char *baseRT_strerror(BaseRTErrorCode code) {
    switch (code) {
    case BASERT_OK: return "OK";
    case BASERT_ERR_UNKNOWN: return "UNKNOWN";
    case BASERT_ERR_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case BASERT_ERR_FILE_NOT_FOUND: return "FILE_NOT_FOUND";
    case BASERT_ERR_INVALID_FORMAT: return "INVALID_FORMAT";
    case BASERT_ERR_UNSUPPORTED: return "UNSUPPORTED";
    case BASERT_ERR_OUT_OF_MEMORY: return "OUT_OF_MEMORY";
    case BASERT_ERR_GPU: return "GPU";
    case BASERT_ERR_GENERATION_FAILED: return "GENERATION_FAILED";
    }
    return "UNKNOWN";
}

/* ---- fault injection ---------------------------------------------------- */

/* Calls left until the fault fires, per kind; 0 = disarmed. */
static atomic_int g_fault_countdown[3];
static pthread_once_t g_fault_env_once = PTHREAD_ONCE_INIT;

static int fault_env_value(const char *name) {
    const char *s = getenv(name);
    if (!s || !*s) return 0;
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (*end != '\0' || v <= 0 || v > INT_MAX) return 0;
    return (int)v;
}

static void fault_read_env(void) {
    atomic_store(&g_fault_countdown[RT_FAULT_STEP], fault_env_value("BASERT_REF_FAIL_STEP"));
    atomic_store(&g_fault_countdown[RT_FAULT_SEQ_CREATE], fault_env_value("BASERT_REF_FAIL_SEQ_CREATE"));
}

bool rt_fault_should_fail(int kind) {
    if (kind != RT_FAULT_STEP && kind != RT_FAULT_SEQ_CREATE) return false;
    pthread_once(&g_fault_env_once, fault_read_env);
    atomic_int *c = &g_fault_countdown[kind];
    int cur = atomic_load(c);
    /* Decrement without ever going below zero; the call that reaches 0 fires. */
    while (cur > 0) {
        if (atomic_compare_exchange_weak(c, &cur, cur - 1)) return cur == 1;
    }
    return false;
}

int baseRT_ref_inject_fault(int kind, int n) {
    if (kind != RT_FAULT_STEP && kind != RT_FAULT_SEQ_CREATE) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "baseRT_ref_inject_fault: unknown fault kind %d", kind);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    if (n < 0) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "baseRT_ref_inject_fault: n must be >= 0, got %d", n);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    /* Read the environment first so it cannot later overwrite this setting. */
    pthread_once(&g_fault_env_once, fault_read_env);
    atomic_store(&g_fault_countdown[kind], n);
    rt_clear_error();
    return BASERT_OK;
}
