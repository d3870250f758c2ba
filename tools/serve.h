/*
 * tools/serve.h - `nflash serve`: an OpenAI-compatible HTTP server
 * (libmicrohttpd) over the engine of tools/serve_engine.h.
 *
 * Three parts:
 *  - requests (serve_api.c): an OpenAI request body parsed and checked
 *    into serve_params, with errors that name the field; response bodies;
 *  - the server (serve.c): HTTP routing, auth, body limits, server-sent
 *    events, /metrics, the slot queue, and the scheduler thread that alone
 *    drives the engine;
 *  - the command: flags, signals.
 *
 * Thread-safety: serve_params functions are pure; a serve_server is
 * started and stopped from one thread, its HTTP threads and its scheduler
 * share state under its lock.
 */
#ifndef NFLASH_TOOLS_SERVE_H
#define NFLASH_TOOLS_SERVE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nflash/chat.h"
#include "nflash/sampler.h"
#include "model_cli.h"

struct json_t;

/* An OpenAI-style error: HTTP status, the field it is about (may be ""),
 * the message, and OpenAI's type ("invalid_request_error", ...). */
struct serve_error {
	int status;
	char param[64];
	char message[512];
	const char *type;
};

/* A checked request. Strings are owned by it (serve_params_free). */
struct serve_params {
	bool chat;                  /* /v1/chat/completions */
	bool stream;
	bool include_usage;         /* stream_options.include_usage */
	char *prompt;               /* completions: text, or NULL with ids */
	int32_t *ids;               /* completions: token ids given as the prompt */
	size_t n_ids;
	struct nf_chat_msg *msgs;   /* chat */
	size_t n_msgs;
	struct nf_sampler_params sp;
	bool seed_set;
	long max_tokens;            /* -1: until the context is full */
	char **stops;
	size_t n_stops;
};

#define SERVE_MAX_STOPS 16

/*
 * serve_params_parse - check a request body (JSON) for the completions
 * (chat false) or chat completions endpoint. Returns 0, or -1 with *err
 * filled (status 400, the field named). p is freed with
 * serve_params_free() in both cases.
 */
int serve_params_parse(const char *body, size_t len, bool chat, struct serve_params *p, struct serve_error *err);
void serve_params_free(struct serve_params *p);

/* Fill *err (printf-style message); returns -1. */
int serve_error_set(struct serve_error *err, int status, const char *param, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
/* {"error": {"message", "type", "param", "code"}} as a string the caller frees. */
char *serve_error_json(const struct serve_error *err);

struct serve_config {
	struct nf_model_cli mc;     /* -m, -c, -t, --memory-budget, ... */
	const char *host;           /* default 127.0.0.1 */
	long port;                  /* default 8080; 0: any free port */
	long parallel;              /* slots, default 1 */
	bool no_batch;              /* --no-batch: decode steps one slot at a time */
	long queue;                 /* requests waiting beyond the slots before 503, default 64 */
	const char *api_key;        /* NULL: no auth */
	const char *alias;          /* model name in the API; default the file's base name */
	const char *chat_template;  /* --chat-template NAME: the family, overriding detection */
	uint64_t max_body;          /* bytes, default 1 MiB */
	long max_connections;       /* default 256 */
};

void serve_config_init(struct serve_config *c);

struct serve_server;

/*
 * serve_server_start - open the model, start the scheduler and listen.
 * Returns an exit code from cli.h after printing the error; on success
 * prints "nflash: serve: listening on http://HOST:PORT" to stderr.
 * c must outlive the server.
 */
int serve_server_start(struct serve_config *c, struct serve_server **out);
/* The port bound (useful with port 0). */
unsigned serve_server_port(const struct serve_server *s);
/* Stop listening, fail what is queued, join threads, close the model. NULL ok. */
void serve_server_stop(struct serve_server *s);

#endif
