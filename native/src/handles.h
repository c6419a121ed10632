#pragma once
/* Generational handle table (handles.c). Model, sequence, decode-stream and
 * grammar handles are table entries, not pointers: a lookup never follows
 * caller memory, and a freed handle stays invalid even when its slot or its
 * object's address is reused. Knows nothing of what the objects are. */

enum { RT_KIND_MODEL = 1, RT_KIND_SEQ = 2, RT_KIND_STREAM = 3, RT_KIND_GRAMMAR = 4 };
enum { RT_HANDLE_OK = 0, RT_HANDLE_STALE = 1, RT_HANDLE_FOREIGN = 2 };
/* A new handle for obj; NULL when out of memory. */
void *rt_handle_new(int kind, void *obj);
/* Invalidate a handle (no-op for a handle that is not live). */
void rt_handle_release(const void *h);
/* The object of a live handle of `kind`, else NULL with *why (may be NULL)
 * RT_HANDLE_STALE (freed) or RT_HANDLE_FOREIGN. */
void *rt_handle_get(const void *h, int kind, int *why);
/* Live handles of a kind, process-wide (tests, through baseRT_ref_*). */
int rt_handle_live_count(int kind);
