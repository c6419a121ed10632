/* JSON Schema subset -> gr_schema (the JSON grammar's restriction). */
#ifndef BASERT_REF_JSON_SCHEMA_H
#define BASERT_REF_JSON_SCHEMA_H

#include "json.h"
#include "json_grammar.h"

/* Compile a parsed schema; BASERT_OK, or an error code set with a message naming fn and the key. */
int gr_schema_compile(const char *fn, const json_value *root, gr_schema *out);

#endif
