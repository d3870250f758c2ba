/*
 * test_tools_serve.c - `nflash serve` over real HTTP on 127.0.0.1: the
 * server runs in this process (so sanitizer builds cover it) on a free
 * port, libcurl is the client. Endpoints, SSE framing, every bad input
 * (400 naming the field, 401, 404, 405, 413, 503), a client that leaves
 * mid-stream, /metrics, and the load test: 32 clients x 8 requests whose
 * greedy outputs must equal the single-client ones, in memory and from a
 * store through the shared neuron cache under a memory budget.
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <curl/curl.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "nflash/engine.h"
#include "../tools/serve.h"
#include "util_pipeline.h"

#define STORIES "../shared/testdata/real/stories260K.gguf"

static struct serve_config cfg;
static struct serve_server *srv;
static char base[64];

/*
 * A memory budget mib MiB above the fixed overhead the engine would count
 * in this process now (its resident set, rounded up, plus slack), which
 * differs between builds (sanitizers) and machines; minus the 8 MiB of
 * slack, which the budgets below already allow for.
 */
static uint64_t budget_over_rss(double mib)
{
	return nf_engine_overhead_now() - NF_ENGINE_SLACK + (uint64_t)(mib * 1048576.0);
}

static void setup(void)
{
	if (access(STORIES, R_OK) != 0)
		cr_skip_test("%s is absent", STORIES);
	curl_global_init(CURL_GLOBAL_DEFAULT);
	serve_config_init(&cfg);
	cfg.mc.path = STORIES;
	cfg.mc.n_threads = 1;
	cfg.mc.n_ctx = 256;
	cfg.port = 0;
	cfg.chat_template = "chatml";
}

/* Serve a store imported from stories260K (removed at the end by the test). */
static void use_store(char *store, size_t len)
{
	pl_import(STORIES, store, len);
	cfg.mc.path = store;
}

static void start(void)
{
	cr_assert_eq(serve_server_start(&cfg, &srv), 0);
	snprintf(base, sizeof(base), "http://127.0.0.1:%u", serve_server_port(srv));
}

static void teardown(void)
{
	serve_server_stop(srv);
	srv = NULL;
	curl_global_cleanup();
}

struct resp {
	long status;
	char *body;
	size_t len;
};

static size_t on_data(char *p, size_t sz, size_t n, void *u)
{
	struct resp *r = u;
	char *b = realloc(r->body, r->len + sz * n + 1);
	if (!b)
		return 0;
	memcpy(b + r->len, p, sz * n);
	r->body = b;
	r->len += sz * n;
	r->body[r->len] = 0;
	return sz * n;
}

/* One request; auth NULL: no Authorization header. */
static void http(const char *method, const char *path, const char *body, const char *auth, struct resp *r)
{
	memset(r, 0, sizeof(*r));
	CURL *c = curl_easy_init();
	cr_assert_not_null(c);
	char url[256], hdr[256];
	snprintf(url, sizeof(url), "%s%s", base, path);
	struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
	if (auth) {
		snprintf(hdr, sizeof(hdr), "Authorization: Bearer %s", auth);
		h = curl_slist_append(h, hdr);
	}
	curl_easy_setopt(c, CURLOPT_URL, url);
	curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
	curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
	if (body)
		curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
	curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
	curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
	curl_easy_setopt(c, CURLOPT_TIMEOUT, 120L);
	curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
	CURLcode rc = curl_easy_perform(c);
	cr_assert_eq(rc, CURLE_OK, "%s %s: %s", method, path, curl_easy_strerror(rc));
	curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
	curl_slist_free_all(h);
	curl_easy_cleanup(c);
	if (!r->body)
		r->body = calloc(1, 1);
}

static json_t *parse(const struct resp *r)
{
	json_error_t e;
	json_t *v = json_loads(r->body, 0, &e);
	cr_assert_not_null(v, "not JSON (%s): %s", e.text, r->body);
	return v;
}

/* The text of a non-streamed answer (malloc'd). */
static char *answer_text(const struct resp *r, bool chat, const char **finish)
{
	json_t *v = parse(r);
	json_t *c0 = json_array_get(json_object_get(v, "choices"), 0);
	json_t *t = chat ? json_object_get(json_object_get(c0, "message"), "content") : json_object_get(c0, "text");
	cr_assert(json_is_string(t), "%s", r->body);
	char *s = strdup(json_string_value(t));
	static _Thread_local char fin[16];   /* the load test's clients call this at once */
	snprintf(fin, sizeof(fin), "%s", json_string_value(json_object_get(c0, "finish_reason")));
	if (finish)
		*finish = fin;
	json_decref(v);
	return s;
}

/*
 * The text of a streamed answer, checking the framing: every event is
 * "data: JSON\n\n", exactly one carries finish_reason (with usage), the
 * last is "data: [DONE]\n\n" and nothing follows it.
 */
static char *sse_text(const struct resp *r, bool chat, long *completion_tokens)
{
	size_t cap = r->len + 1, tl = 0;
	char *text = calloc(1, cap);
	const char *p = r->body;
	int finishes = 0;
	bool done = false;
	while (*p) {
		cr_assert(!done, "bytes after [DONE]: %s", p);
		cr_assert(!strncmp(p, "data: ", 6), "event without 'data: ': %.60s", p);
		const char *end = strstr(p, "\n\n");
		cr_assert_not_null(end, "event not ended by a blank line: %.60s", p);
		if (!strncmp(p + 6, "[DONE]", 6)) {
			cr_assert_eq(end, p + 12);
			done = true;
			p = end + 2;
			continue;
		}
		json_error_t e;
		json_t *v = json_loadb(p + 6, (size_t)(end - p - 6), 0, &e);
		cr_assert_not_null(v, "event is not JSON: %.80s", p);
		cr_assert_str_eq(json_string_value(json_object_get(v, "object")),
				 chat ? "chat.completion.chunk" : "text_completion");
		json_t *c0 = json_array_get(json_object_get(v, "choices"), 0);
		if (c0) {
			json_t *t = chat ? json_object_get(json_object_get(c0, "delta"), "content")
					 : json_object_get(c0, "text");
			if (json_is_string(t)) {
				memcpy(text + tl, json_string_value(t), json_string_length(t));
				tl += json_string_length(t);
			}
			if (json_is_string(json_object_get(c0, "finish_reason"))) {
				finishes++;
				json_t *u = json_object_get(v, "usage");
				cr_assert(json_is_object(u), "final chunk without usage");
				if (completion_tokens)
					*completion_tokens = (long)json_integer_value(json_object_get(u, "completion_tokens"));
			}
		}
		json_decref(v);
		p = end + 2;
	}
	cr_assert(done, "no data: [DONE]");
	cr_assert_eq(finishes, 1);
	return text;
}

static void expect_error(const struct resp *r, long status, const char *param)
{
	cr_expect_eq(r->status, status, "status %ld, expected %ld: %s", r->status, status, r->body);
	json_t *v = parse(r);
	json_t *e = json_object_get(v, "error");
	cr_assert(json_is_object(e), "no error object: %s", r->body);
	cr_expect(json_is_string(json_object_get(e, "message")));
	cr_expect(json_is_string(json_object_get(e, "type")));
	json_t *pm = json_object_get(e, "param");
	if (param)
		cr_expect(json_is_string(pm) && !strcmp(json_string_value(pm), param), "param %s, expected %s: %s",
			  json_string_value(pm), param, r->body);
	json_decref(v);
}

/* The value of name in a /metrics body. */
static unsigned long long metric_in(const char *body, const char *name)
{
	char key[128];
	snprintf(key, sizeof(key), "\n%s ", name);
	const char *at = strstr(body, key);
	cr_assert_not_null(at, "no %s in /metrics", name);
	return strtoull(at + strlen(key), NULL, 10);
}

static unsigned long long metric(const char *name)
{
	struct resp r;
	http("GET", "/metrics", NULL, NULL, &r);
	cr_assert_eq(r.status, 200);
	unsigned long long v = metric_in(r.body, name);
	free(r.body);
	return v;
}

static const char *const prompts[] = { "Once upon a time", "The cat sat", "Lily and Ben went", "One day" };

static void body_for(char *out, size_t len, int k, bool chat, bool stream, int max_tokens)
{
	if (chat)
		snprintf(out, len, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],"
			 "\"max_tokens\":%d,\"temperature\":0,\"stream\":%s}", prompts[k], max_tokens,
			 stream ? "true" : "false");
	else
		snprintf(out, len, "{\"model\":\"m\",\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"stream\":%s}",
			 prompts[k], max_tokens, stream ? "true" : "false");
}

TestSuite(serve, .init = setup, .fini = teardown, .timeout = 600 * NF_TEST_SLOWDOWN);

Test(serve, endpoints_and_sse_framing)
{
	start();
	struct resp r;
	http("GET", "/health", NULL, NULL, &r);
	cr_expect_eq(r.status, 200);
	cr_expect(strstr(r.body, "\"ok\""));
	free(r.body);
	http("GET", "/v1/models", NULL, NULL, &r);
	cr_expect_eq(r.status, 200);
	json_t *v = parse(&r);
	cr_expect_str_eq(json_string_value(json_object_get(json_array_get(json_object_get(v, "data"), 0), "id")),
			 "stories260K.gguf");
	json_decref(v);
	free(r.body);

	for (int chat = 0; chat < 2; chat++) {
		char body[512];
		body_for(body, sizeof(body), 0, chat, false, 24);
		http("POST", chat ? "/v1/chat/completions" : "/v1/completions", body, NULL, &r);
		cr_assert_eq(r.status, 200, "%s", r.body);
		v = parse(&r);
		json_t *u = json_object_get(v, "usage");
		cr_expect_eq(json_integer_value(json_object_get(u, "completion_tokens")), 24);
		cr_expect(json_integer_value(json_object_get(u, "prompt_tokens")) > 0);
		json_decref(v);
		const char *fin;
		char *plain = answer_text(&r, chat, &fin);
		cr_expect_str_eq(fin, "length");
		cr_expect(strlen(plain) > 10, "'%s'", plain);
		if (!chat)
			cr_expect(!strncmp(plain, ", there was a little girl named Lily", 36), "'%s'", plain);
		free(r.body);

		body_for(body, sizeof(body), 0, chat, true, 24);
		http("POST", chat ? "/v1/chat/completions" : "/v1/completions", body, NULL, &r);
		cr_assert_eq(r.status, 200);
		long n = 0;
		char *streamed = sse_text(&r, chat, &n);
		cr_expect_str_eq(streamed, plain, "streamed text differs from the plain answer");
		cr_expect_eq(n, 24);
		free(streamed);
		free(plain);
		free(r.body);
	}
	/* a stop string ends the text before it */
	http("POST", "/v1/completions",
	     "{\"prompt\":\"Once upon a time\",\"max_tokens\":40,\"temperature\":0,\"stop\":[\"little\",\"zzz\"]}", NULL,
	     &r);
	const char *fin;
	char *t = answer_text(&r, false, &fin);
	cr_expect_str_eq(t, ", there was a ");
	cr_expect_str_eq(fin, "stop");
	free(t);
	free(r.body);
	/* token ids as the prompt; a fixed seed repeats a sampled answer */
	const char *seeded = "{\"prompt\":[1,415,200],\"max_tokens\":16,\"temperature\":0.9,\"seed\":7,"
			     "\"frequency_penalty\":0.5,\"presence_penalty\":0.2,\"top_k\":20,\"top_p\":0.9,\"min_p\":0.01}";
	http("POST", "/v1/completions", seeded, NULL, &r);
	cr_assert_eq(r.status, 200, "%s", r.body);
	char *a = answer_text(&r, false, NULL);
	free(r.body);
	http("POST", "/v1/completions", seeded, NULL, &r);
	char *b = answer_text(&r, false, NULL);
	cr_expect_str_eq(a, b);
	free(a);
	free(b);
	free(r.body);

	cr_expect(metric("nflash_generated_tokens_total") >= 4 * 24);
	cr_expect(metric("nflash_prompt_tokens_total") > 0);
	cr_expect_eq(metric("nflash_slots"), 1);
}

Test(serve, bad_input)
{
	cfg.api_key = "sekret";
	cfg.max_body = 4096;
	cfg.mc.n_ctx = 64;
	start();
	struct resp r;
	const char *key = "sekret";
	http("POST", "/v1/completions", "{\"prompt\":\"hi\"}", NULL, &r);
	expect_error(&r, 401, NULL);
	free(r.body);
	http("POST", "/v1/completions", "{\"prompt\":\"hi\"}", "wrong", &r);
	expect_error(&r, 401, NULL);
	free(r.body);
	http("GET", "/v1/models", NULL, "sekre", &r);
	expect_error(&r, 401, NULL);
	free(r.body);
	http("GET", "/health", NULL, NULL, &r);    /* open to probes */
	cr_expect_eq(r.status, 200);
	free(r.body);

	static const struct { const char *body, *param; } bad[] = {
		{ "{\"prompt\":\"hi\"", NULL },                                /* malformed */
		{ "[1,2]", NULL },                                             /* not an object */
		{ "{\"prompt\":\"hi\",\"temperature\":\"hot\"}", "temperature" },
		{ "{\"prompt\":\"hi\",\"temperature\":5}", "temperature" },
		{ "{\"prompt\":\"hi\",\"max_tokens\":1.5}", "max_tokens" },
		{ "{\"prompt\":\"hi\",\"max_tokens\":0}", "max_tokens" },
		{ "{\"prompt\":\"hi\",\"top_k\":-1}", "top_k" },
		{ "{\"prompt\":\"hi\",\"stop\":7}", "stop" },
		{ "{\"prompt\":\"hi\",\"stop\":[\"\"]}", "stop" },
		{ "{\"prompt\":\"hi\",\"seed\":\"x\"}", "seed" },
		{ "{\"prompt\":\"hi\",\"stream\":1}", "stream" },
		{ "{\"prompt\":\"hi\",\"n\":2}", "n" },
		{ "{\"prompt\":\"hi\",\"logprobs\":1}", "logprobs" },
		{ "{\"prompt\":\"hi\",\"no_such_field\":1}", "no_such_field" },
		{ "{\"prompt\":\"hi\",\"frequency_penalty\":3}", "frequency_penalty" },
		{ "{\"prompt\":7}", "prompt" },
		{ "{\"prompt\":[1,-2]}", "prompt" },
		{ "{\"prompt\":[1,99999]}", "prompt" },
		{ "{\"max_tokens\":3}", "prompt" },
		{ "{\"prompt\":\"one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
		  "fifteen sixteen seventeen eighteen nineteen twenty twenty-one twenty-two twenty-three "
		  "twenty-four twenty-five twenty-six twenty-seven twenty-eight twenty-nine thirty\"}", "prompt" },
		/* over -c 64 */
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		http("POST", "/v1/completions", bad[i].body, key, &r);
		expect_error(&r, 400, bad[i].param);
		free(r.body);
	}
	static const struct { const char *body, *param; } bad_chat[] = {
		{ "{\"messages\":\"hi\"}", "messages" },
		{ "{\"messages\":[]}", "messages" },
		{ "{\"messages\":[{\"role\":\"robot\",\"content\":\"hi\"}]}", "messages[0].role" },
		{ "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", "messages[0].content" },
		{ "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\",\"tool_calls\":[]}]}", "messages[0]" },
		{ "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[]}", "tools" },
		{ "{\"prompt\":\"hi\"}", "prompt" },
	};
	for (size_t i = 0; i < sizeof(bad_chat) / sizeof(bad_chat[0]); i++) {
		http("POST", "/v1/chat/completions", bad_chat[i].body, key, &r);
		expect_error(&r, 400, bad_chat[i].param);
		free(r.body);
	}
	/* a content given as text parts is accepted */
	http("POST", "/v1/chat/completions",
	     "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hi\"}]}],\"max_tokens\":2}",
	     key, &r);
	cr_expect_eq(r.status, 200, "%s", r.body);
	free(r.body);

	char *big = malloc(8192);
	memset(big, ' ', 8191);
	memcpy(big, "{\"prompt\":\"", 11);
	memcpy(big + 8189, "\"}", 3);
	http("POST", "/v1/completions", big, key, &r);
	expect_error(&r, 413, NULL);
	free(r.body);
	free(big);
	http("GET", "/v1/nothing", NULL, key, &r);
	expect_error(&r, 404, NULL);
	free(r.body);
	http("GET", "/v1/completions", NULL, key, &r);
	expect_error(&r, 405, NULL);
	free(r.body);
	/* after all that, it still serves */
	http("POST", "/v1/completions", "{\"prompt\":\"Once\",\"max_tokens\":3}", key, &r);
	cr_expect_eq(r.status, 200, "%s", r.body);
	free(r.body);
}

/* A raw socket that sends a streaming request and reads its first event. */
static int open_stream(const char *body)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	cr_assert(fd >= 0);
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)serve_server_port(srv)) };
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
	char req[1024];
	int n = snprintf(req, sizeof(req), "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
			 "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
	cr_assert_eq(write(fd, req, (size_t)n), n);
	char buf[4096];
	size_t got = 0;
	while (got < sizeof(buf) - 1) {
		ssize_t k = read(fd, buf + got, sizeof(buf) - 1 - got);
		cr_assert(k > 0, "the stream ended before its first event");
		got += (size_t)k;
		buf[got] = 0;
		if (strstr(buf, "data: "))
			break;
	}
	cr_assert(strstr(buf, " 200 "), "%s", buf);
	return fd;
}

/* A streamed store makes decoding slow enough to watch: the queue is full
 * while one request runs, and a client that leaves frees its slot. */
Test(serve, queue_full_and_client_leaving)
{
	char store[256];
	use_store(store, sizeof(store));
	/* a budget, through the cache: 24 MiB over the resident set, as the
	 * load tests, because the set grows between here and the engine's
	 * open (the import, the server's threads; by 4 MiB or more under
	 * ASan), and an 11 MiB margin was refused now and then */
	cfg.mc.budget = budget_over_rss(24);
	cfg.parallel = 1;
	cfg.queue = 0;
	start();
	int fd = open_stream("{\"prompt\":\"Once upon a time\",\"max_tokens\":200,\"temperature\":0,\"stream\":true}");
	struct resp r;
	http("POST", "/v1/completions", "{\"prompt\":\"Once\",\"max_tokens\":2}", NULL, &r);
	expect_error(&r, 503, NULL);
	free(r.body);
	cr_expect_eq(metric("nflash_slots_busy"), 1);
	close(fd);
	/* the slot is freed at the next token, long before 200 tokens */
	int busy = 1;
	for (int i = 0; i < 200 && busy; i++) {
		usleep(10000);
		busy = (int)metric("nflash_slots_busy");
	}
	cr_expect_eq(busy, 0, "the slot stayed busy after its client left");
	cr_expect(metric("nflash_generated_tokens_total") < 200, "the request ran to its end after the client left");
	http("POST", "/v1/completions", "{\"prompt\":\"Once\",\"max_tokens\":2}", NULL, &r);
	cr_expect_eq(r.status, 200, "%s", r.body);
	free(r.body);
	cr_expect(metric("nflash_read_bytes_total") > 0);
	cr_expect(metric("nflash_cache_lookups_total") > 0);
	unlink(store);
}

/* ---- load: 32 clients x 8 requests --------------------------------------- */

#define N_CLIENTS 32
#define N_REQS 8
#define LOAD_TOKENS 12

static char *ref_text[4][2];   /* [prompt][chat] */

struct client {
	int id;
	int ok, busy, wrong;
	char why[256];
};

static void *client_main(void *arg)
{
	struct client *cl = arg;
	for (int i = 0; i < N_REQS; i++) {
		int k = (cl->id + i) % 4;
		bool chat = (cl->id + i) % 3 == 0, stream = (cl->id * 7 + i) % 2 == 0;
		char body[512];
		body_for(body, sizeof(body), k, chat, stream, LOAD_TOKENS);
		struct resp r;
		http("POST", chat ? "/v1/chat/completions" : "/v1/completions", body, NULL, &r);
		if (r.status == 503) {
			cl->busy++;
		} else if (r.status != 200) {
			cl->wrong++;
			snprintf(cl->why, sizeof(cl->why), "status %ld: %.200s", r.status, r.body);
		} else {
			char *t = stream ? sse_text(&r, chat, NULL) : answer_text(&r, chat, NULL);
			if (strcmp(t, ref_text[k][chat])) {
				cl->wrong++;
				snprintf(cl->why, sizeof(cl->why), "'%s' != '%s'", t, ref_text[k][chat]);
			} else {
				cl->ok++;
			}
			free(t);
		}
		free(r.body);
	}
	return NULL;
}

static void load_test(void)
{
	start();
	for (int k = 0; k < 4; k++)
		for (int chat = 0; chat < 2; chat++) {
			char body[512];
			body_for(body, sizeof(body), k, chat, false, LOAD_TOKENS);
			struct resp r;
			http("POST", chat ? "/v1/chat/completions" : "/v1/completions", body, NULL, &r);
			cr_assert_eq(r.status, 200, "%s", r.body);
			ref_text[k][chat] = answer_text(&r, chat, NULL);
			free(r.body);
		}
	pthread_t th[N_CLIENTS];
	struct client cl[N_CLIENTS];
	for (int i = 0; i < N_CLIENTS; i++) {
		cl[i] = (struct client){ .id = i };
		cr_assert_eq(pthread_create(&th[i], NULL, client_main, &cl[i]), 0);
	}
	int ok = 0, busy = 0;
	for (int i = 0; i < N_CLIENTS; i++) {
		pthread_join(th[i], NULL);
		cr_expect_eq(cl[i].wrong, 0, "client %d: %s", i, cl[i].why);
		ok += cl[i].ok;
		busy += cl[i].busy;
	}
	cr_expect_eq(ok + busy, N_CLIENTS * N_REQS);
	cr_expect(ok > 0);
	cr_expect_eq(metric("nflash_slots_busy"), 0);
	cr_expect_eq(metric("nflash_queue_depth"), 0);
	/* the outputs above came from batched decode steps, not only alone */
	if (cfg.parallel > 1 && !cfg.no_batch)
		cr_expect_gt(metric("nflash_decode_batched_steps_total"), 0, "no decode step ran as a batch");
	else
		cr_expect_eq(metric("nflash_decode_batched_steps_total"), 0);
	/* from one scrape: the engine thread may still count a step whose
	 * tokens the clients have had (seen under TSan) */
	struct resp mr;
	http("GET", "/metrics", NULL, NULL, &mr);
	cr_assert_eq(mr.status, 200);
	cr_expect_eq(metric_in(mr.body, "nflash_decode_batch_size_bucket{le=\"+Inf\"}"),
		     metric_in(mr.body, "nflash_decode_steps_total"), "the histogram's buckets miss steps");
	cr_expect_eq(metric_in(mr.body, "nflash_decode_batch_size_count"),
		     metric_in(mr.body, "nflash_decode_steps_total"));
	free(mr.body);
	for (int k = 0; k < 4; k++)
		for (int chat = 0; chat < 2; chat++)
			free(ref_text[k][chat]);
}

Test(serve, load_32_clients_greedy_equals_single)
{
	cfg.parallel = 4;
	load_test();
}

Test(serve, load_from_store_shared_cache)
{
	char store[256];
	use_store(store, sizeof(store));
	/* room for the whole cache and all 3 slots: one open (a second one in
	 * the same process would count a larger resident set as overhead) */
	cfg.mc.budget = budget_over_rss(24);
	cfg.parallel = 3;
	load_test();
	cr_expect(metric("nflash_read_bytes_total") > 0);
	unlink(store);
}

/* Attention streamed from the store (only the engine's context holds a
 * stream) with several slots: every slot's rows go through it. */
Test(serve, load_with_streamed_attention)
{
	char store[256];
	use_store(store, sizeof(store));
	cfg.mc.stream_attn = true;
	cfg.parallel = 3;
	load_test();
	unlink(store);
}

/* --no-batch: the same answers, one slot per decode step. */
Test(serve, load_without_batching)
{
	cfg.parallel = 3;
	cfg.no_batch = true;
	load_test();
}

/* An I/O error while serving: the store's FFN bytes vanish (the file is
 * truncated under a running server), the request that needed them fails
 * with 500 and the server goes on answering; with the bytes back, the
 * answer equals a healthy server's (nothing wrong was kept in the cache). */
Test(serve, io_error_is_500_and_serving_goes_on)
{
	char store[256];
	use_store(store, sizeof(store));
	const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":16,\"temperature\":0}";
	struct resp r;
	start();
	http("POST", "/v1/completions", body, NULL, &r);
	cr_assert_eq(r.status, 200, "%s", r.body);
	char *want = answer_text(&r, false, NULL);
	free(r.body);
	serve_server_stop(srv);

	start();   /* a cache that has read nothing yet */
	FILE *f = fopen(store, "rb");
	cr_assert_not_null(f);
	fseek(f, 0, SEEK_END);
	long size = ftell(f);
	char *bytes = malloc((size_t)size);
	fseek(f, 0, SEEK_SET);
	cr_assert_eq(fread(bytes, 1, (size_t)size, f), (size_t)size);
	fclose(f);
	cr_assert_eq(truncate(store, 4096), 0);
	http("POST", "/v1/completions", body, NULL, &r);
	expect_error(&r, 500, NULL);
	free(r.body);
	http("GET", "/health", NULL, NULL, &r);
	cr_expect_eq(r.status, 200);
	free(r.body);
	cr_expect(metric("nflash_read_errors_total") > 0);
	cr_expect_eq(metric("nflash_slots_busy"), 0);

	f = fopen(store, "r+b");
	cr_assert_not_null(f);
	cr_assert_eq(fwrite(bytes, 1, (size_t)size, f), (size_t)size);
	fclose(f);
	free(bytes);
	http("POST", "/v1/completions", body, NULL, &r);
	cr_expect_eq(r.status, 200, "%s", r.body);
	if (r.status == 200) {
		char *again = answer_text(&r, false, NULL);
		cr_expect_str_eq(again, want);
		free(again);
	}
	free(r.body);
	free(want);
	unlink(store);
}

/* Every slot's KV cache is in the budget: one that cannot hold them all is
 * refused at start, naming --parallel. */
Test(serve, budget_must_hold_every_slot)
{
	char store[256];
	use_store(store, sizeof(store));
	cfg.mc.budget = budget_over_rss(11);
	cfg.parallel = 200;
	cr_expect_neq(serve_server_start(&cfg, &srv), 0);
	srv = NULL;
	unlink(store);
}
