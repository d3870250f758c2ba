/*
 * serve_api.c - OpenAI request bodies checked into serve_params, and error
 * bodies, for `nflash serve` (see serve.h).
 *
 * Invariants: every field is checked for its type and range before use; a
 * field nflash does not support, or does not know, is refused with a 400
 * that names it, never ignored; the first error found is the one reported.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "serve.h"

int serve_error_set(struct serve_error *err, int status, const char *param, const char *fmt, ...)
{
	va_list ap;
	err->status = status;
	snprintf(err->param, sizeof(err->param), "%s", param ? param : "");
	va_start(ap, fmt);
	vsnprintf(err->message, sizeof(err->message), fmt, ap);
	va_end(ap);
	if (!err->type)
		err->type = status == 401 ? "authentication_error" :
			    status >= 500 ? "server_error" : "invalid_request_error";
	return -1;
}

char *serve_error_json(const struct serve_error *err)
{
	json_t *e = json_pack("{s:{s:s, s:s, s:o, s:n}}", "error", "message", err->message, "type",
			      err->type ? err->type : "invalid_request_error", "param",
			      err->param[0] ? json_string(err->param) : json_null(), "code");
	char *s = e ? json_dumps(e, JSON_COMPACT) : NULL;
	json_decref(e);
	return s;
}

void serve_params_free(struct serve_params *p)
{
	if (!p)
		return;
	free(p->prompt);
	free(p->ids);
	for (size_t i = 0; i < p->n_msgs; i++) {
		free((char *)p->msgs[i].role);
		free((char *)p->msgs[i].content);
	}
	free(p->msgs);
	for (size_t i = 0; i < p->n_stops; i++)
		free(p->stops[i]);
	free(p->stops);
	memset(p, 0, sizeof(*p));
}

/* ---- field checks ----------------------------------------------------- */

static int bad_type(struct serve_error *err, const char *key, const char *want)
{
	return serve_error_set(err, 400, key, "'%s' must be %s", key, want);
}

/* A number in [lo, hi] (null leaves *out alone). */
static int get_number(json_t *v, const char *key, double lo, double hi, float *out, struct serve_error *err)
{
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_number(v))
		return bad_type(err, key, "a number");
	double x = json_number_value(v);
	if (!isfinite(x) || x < lo || x > hi)
		return serve_error_set(err, 400, key, "'%s' must be between %g and %g, got %g", key, lo, hi, x);
	*out = (float)x;
	return 0;
}

static int get_int(json_t *v, const char *key, long long lo, long long hi, long long *out, struct serve_error *err)
{
	if (!v || json_is_null(v))
		return 1;
	if (!json_is_integer(v))
		return bad_type(err, key, "an integer");
	long long x = json_integer_value(v);
	if (x < lo || x > hi)
		return serve_error_set(err, 400, key, "'%s' must be between %lld and %lld, got %lld", key, lo, hi, x);
	*out = x;
	return 0;
}

static int get_bool(json_t *v, const char *key, bool *out, struct serve_error *err)
{
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_boolean(v))
		return bad_type(err, key, "true or false");
	*out = json_is_true(v);
	return 0;
}

static char *dup_str(json_t *v)
{
	return strndup(json_string_value(v), json_string_length(v));
}

static int get_stops(json_t *v, struct serve_params *p, struct serve_error *err)
{
	if (!v || json_is_null(v))
		return 0;
	size_t n = json_is_string(v) ? 1 : json_is_array(v) ? json_array_size(v) : 0;
	if (!json_is_string(v) && !json_is_array(v))
		return bad_type(err, "stop", "a string or an array of strings");
	if (n > SERVE_MAX_STOPS)
		return serve_error_set(err, 400, "stop", "'stop' takes at most %d strings, got %zu", SERVE_MAX_STOPS, n);
	p->stops = calloc(n ? n : 1, sizeof(*p->stops));
	if (!p->stops)
		return serve_error_set(err, 500, NULL, "out of memory");
	for (size_t i = 0; i < n; i++) {
		json_t *s = json_is_string(v) ? v : json_array_get(v, i);
		if (!json_is_string(s))
			return bad_type(err, "stop", "a string or an array of strings");
		if (json_string_length(s) == 0)
			return serve_error_set(err, 400, "stop", "'stop' strings must not be empty");
		if (!(p->stops[p->n_stops++] = dup_str(s)))
			return serve_error_set(err, 500, NULL, "out of memory");
	}
	return 0;
}

/* prompt: a string, an array of one string, or an array of token ids. */
static int get_prompt(json_t *v, struct serve_params *p, struct serve_error *err)
{
	if (!v)
		return serve_error_set(err, 400, "prompt", "'prompt' is required");
	if (json_is_array(v) && json_array_size(v) == 1 && json_is_string(json_array_get(v, 0)))
		v = json_array_get(v, 0);
	if (json_is_string(v)) {
		p->prompt = dup_str(v);
		return p->prompt ? 0 : serve_error_set(err, 500, NULL, "out of memory");
	}
	if (!json_is_array(v) || json_array_size(v) == 0)
		return bad_type(err, "prompt", "a string, or a non-empty array of token ids");
	size_t n = json_array_size(v);
	p->ids = malloc(n * sizeof(*p->ids));
	if (!p->ids)
		return serve_error_set(err, 500, NULL, "out of memory");
	for (size_t i = 0; i < n; i++) {
		json_t *x = json_array_get(v, i);
		if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX) {
			if (json_is_string(x))
				return serve_error_set(err, 400, "prompt",
						       "'prompt': batches of several prompts are not supported");
			return bad_type(err, "prompt", "a string, or an array of token ids");
		}
		p->ids[i] = (int32_t)json_integer_value(x);
	}
	p->n_ids = n;
	return 0;
}

/* content: a string, or an array of {"type": "text", "text": ...} parts. */
static char *get_content(json_t *c, size_t i, struct serve_error *err)
{
	char where[64];
	snprintf(where, sizeof(where), "messages[%zu].content", i);
	if (json_is_string(c)) {
		char *s = dup_str(c);
		if (!s)
			serve_error_set(err, 500, NULL, "out of memory");
		return s;
	}
	if (!json_is_array(c)) {
		bad_type(err, where, "a string or an array of text parts");
		return NULL;
	}
	size_t len = 0, idx;
	json_t *part;
	json_array_foreach(c, idx, part) {
		json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
		if (!json_is_string(type) || strcmp(json_string_value(type), "text") != 0) {
			serve_error_set(err, 400, where, "'%s': only parts of type \"text\" are supported", where);
			return NULL;
		}
		if (!json_is_string(text)) {
			bad_type(err, where, "parts whose 'text' is a string");
			return NULL;
		}
		len += json_string_length(text);
	}
	char *s = malloc(len + 1);
	if (!s) {
		serve_error_set(err, 500, NULL, "out of memory");
		return NULL;
	}
	len = 0;
	json_array_foreach(c, idx, part) {
		json_t *text = json_object_get(part, "text");
		memcpy(s + len, json_string_value(text), json_string_length(text));
		len += json_string_length(text);
	}
	s[len] = 0;
	return s;
}

static int get_messages(json_t *v, struct serve_params *p, struct serve_error *err)
{
	if (!v)
		return serve_error_set(err, 400, "messages", "'messages' is required");
	if (!json_is_array(v) || json_array_size(v) == 0)
		return bad_type(err, "messages", "a non-empty array of messages");
	size_t n = json_array_size(v);
	p->msgs = calloc(n, sizeof(*p->msgs));
	if (!p->msgs)
		return serve_error_set(err, 500, NULL, "out of memory");
	for (size_t i = 0; i < n; i++) {
		json_t *m = json_array_get(v, i), *role, *content;
		char where[64];
		snprintf(where, sizeof(where), "messages[%zu]", i);
		if (!json_is_object(m))
			return bad_type(err, where, "an object");
		const char *key;
		json_t *val;
		json_object_foreach(m, key, val) {
			if (strcmp(key, "role") && strcmp(key, "content") && strcmp(key, "name"))
				return serve_error_set(err, 400, where, "'%s.%s' is not supported", where, key);
		}
		role = json_object_get(m, "role");
		content = json_object_get(m, "content");
		snprintf(where, sizeof(where), "messages[%zu].role", i);
		if (!json_is_string(role))
			return bad_type(err, where, "\"system\", \"user\" or \"assistant\"");
		const char *r = json_string_value(role);
		if (!strcmp(r, "developer"))
			r = "system";    /* OpenAI's newer name for the system role */
		if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant"))
			return serve_error_set(err, 400, where, "'%s' must be \"system\", \"user\" or \"assistant\", got \"%s\"",
					       where, r);
		char *ct = get_content(content, i, err);
		if (!ct)
			return -1;
		p->msgs[i].content = ct;
		p->n_msgs = i + 1;
		if (!(p->msgs[i].role = strdup(r)))
			return serve_error_set(err, 500, NULL, "out of memory");
	}
	return 0;
}

/* Fields accepted on both endpoints, and fields of one. */
static const char *const common_keys[] = {
	"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
	"stop", "seed", "frequency_penalty", "presence_penalty", "repeat_penalty", "repeat_last_n", "n",
	"user", NULL,
};

static bool known_key(const char *key, bool chat)
{
	for (size_t i = 0; common_keys[i]; i++)
		if (!strcmp(key, common_keys[i]))
			return true;
	return chat ? !strcmp(key, "messages") || !strcmp(key, "max_completion_tokens") : !strcmp(key, "prompt");
}

static int get_sampling(json_t *root, struct serve_params *p, struct serve_error *err)
{
	long long x;
	int r;
	p->sp = nf_sampler_defaults();
	if (get_number(json_object_get(root, "temperature"), "temperature", 0, 2, &p->sp.temp, err) ||
	    get_number(json_object_get(root, "top_p"), "top_p", 0, 1, &p->sp.top_p, err) ||
	    get_number(json_object_get(root, "min_p"), "min_p", 0, 1, &p->sp.min_p, err) ||
	    get_number(json_object_get(root, "frequency_penalty"), "frequency_penalty", -2, 2, &p->sp.freq_penalty, err) ||
	    get_number(json_object_get(root, "presence_penalty"), "presence_penalty", -2, 2, &p->sp.presence_penalty, err) ||
	    get_number(json_object_get(root, "repeat_penalty"), "repeat_penalty", 1e-3, 100, &p->sp.repeat_penalty, err))
		return -1;
	if ((r = get_int(json_object_get(root, "top_k"), "top_k", 0, 1 << 30, &x, err)) < 0)
		return -1;
	if (r == 0)
		p->sp.top_k = (int32_t)x;
	if ((r = get_int(json_object_get(root, "repeat_last_n"), "repeat_last_n", 0, 1 << 20, &x, err)) < 0)
		return -1;
	if (r == 0)
		p->sp.repeat_last_n = (int32_t)x;
	if ((r = get_int(json_object_get(root, "seed"), "seed", INT64_MIN, INT64_MAX, &x, err)) < 0)
		return -1;
	if (r == 0) {
		p->sp.seed = (uint64_t)x;
		p->seed_set = true;
	}
	return 0;
}

int serve_params_parse(const char *body, size_t len, bool chat, struct serve_params *p, struct serve_error *err)
{
	memset(p, 0, sizeof(*p));
	p->chat = chat;
	p->max_tokens = -1;
	json_error_t je;
	json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
	int rc = -1;
	if (!root)
		return serve_error_set(err, 400, NULL, "the body is not valid JSON: %s (line %d, column %d)", je.text,
				       je.line, je.column);
	if (!json_is_object(root)) {
		serve_error_set(err, 400, NULL, "the body must be a JSON object");
		goto out;
	}
	const char *key;
	json_t *v;
	json_object_foreach(root, key, v) {
		if (!known_key(key, chat)) {
			serve_error_set(err, 400, key, "'%s' is not supported by nflash serve", key);
			goto out;
		}
	}
	if ((v = json_object_get(root, "model")) && !json_is_string(v) && !json_is_null(v)) {
		bad_type(err, "model", "a string");
		goto out;
	}
	if ((v = json_object_get(root, "user")) && !json_is_string(v) && !json_is_null(v)) {
		bad_type(err, "user", "a string");
		goto out;
	}
	long long n = 1;
	if (get_int(json_object_get(root, "n"), "n", 1, 1, &n, err) < 0) {
		snprintf(err->message, sizeof(err->message), "'n': only 1 choice per request is supported");
		goto out;
	}
	if (get_bool(json_object_get(root, "stream"), "stream", &p->stream, err) < 0)
		goto out;
	if ((v = json_object_get(root, "stream_options")) && !json_is_null(v)) {
		if (!json_is_object(v)) {
			bad_type(err, "stream_options", "an object");
			goto out;
		}
		json_t *o = v;
		json_object_foreach(o, key, v) {
			if (strcmp(key, "include_usage")) {
				serve_error_set(err, 400, "stream_options", "'stream_options.%s' is not supported", key);
				goto out;
			}
			if (get_bool(v, "stream_options.include_usage", &p->include_usage, err) < 0)
				goto out;
		}
	}
	long long mt;
	const char *mt_key = chat && json_object_get(root, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
	int r = get_int(json_object_get(root, mt_key), mt_key, 1, INT32_MAX, &mt, err);
	if (r < 0)
		goto out;
	if (r == 0)
		p->max_tokens = (long)mt;
	if (get_sampling(root, p, err) < 0 || get_stops(json_object_get(root, "stop"), p, err) < 0)
		goto out;
	if (chat ? get_messages(json_object_get(root, "messages"), p, err) < 0
		 : get_prompt(json_object_get(root, "prompt"), p, err) < 0)
		goto out;
	rc = 0;
out:
	json_decref(root);
	return rc;
}
