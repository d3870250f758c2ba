/*
 * tests/tsan/criterion/criterion.h - the subset of Criterion's API the
 * nflash suite uses, for builds Criterion cannot run: under ThreadSanitizer
 * Criterion cannot start its arena (Snaipe/Criterion#274), so
 * `make test SANITIZE=thread` compiles the same test files against this
 * header and links tests/tsan/runner.c instead of -lcriterion. Each test
 * runs in a forked child, as under Criterion; tsan_runner prints one line
 * per failure or skip and closes with "N passed, N failed, N skipped".
 *
 * Message arguments must start with a string literal (as every call in
 * tests/ does).
 */
#ifndef NFLASH_TSAN_CRITERION_H
#define NFLASH_TSAN_CRITERION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Criterion's comparisons are generic; these are plain C operators. */
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

struct tsan_test {
	const char *suite, *name;
	void (*fn)(void);
	void (*init)(void);
	void (*fini)(void);
	double timeout;
	struct tsan_test *next;
};
struct tsan_suite {
	const char *name;
	void (*init)(void);
	void (*fini)(void);
	double timeout;
	struct tsan_suite *next;
};
void tsan_register(struct tsan_test *t);
void tsan_register_suite(struct tsan_suite *s);
/* An assert stops the test; an expect lets it go on. */
void tsan_assert_fail(const char *file, int line, const char *expr, const char *fmt, ...)
	__attribute__((format(printf, 4, 5), noreturn));
void tsan_expect_fail(const char *file, int line, const char *expr, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
void tsan_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
void tsan_log(const char *level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define Test(S_, N_, ...)                                                          \
	static void S_##_##N_##_impl(void);                                        \
	static struct tsan_test S_##_##N_##_test = {                              \
		.suite = #S_, .name = #N_, .fn = S_##_##N_##_impl, __VA_ARGS__ };     \
	__attribute__((constructor)) static void S_##_##N_##_reg(void)             \
	{                                                                               \
		tsan_register(&S_##_##N_##_test);                                  \
	}                                                                               \
	static void S_##_##N_##_impl(void)

#define TestSuite(S_, ...)                                                           \
	static struct tsan_suite S_##_suite_ = { .name = #S_, __VA_ARGS__ };      \
	__attribute__((constructor)) static void S_##_suite_reg(void)               \
	{                                                                               \
		tsan_register_suite(&S_##_suite_);                                   \
	}

#define TSAN_CHECK(fatal, cond, expr, ...)                                              \
	do {                                                                            \
		if (!(cond)) {                                                          \
			if (fatal)                                                      \
				tsan_assert_fail(__FILE__, __LINE__, expr, " " __VA_ARGS__); \
			else                                                            \
				tsan_expect_fail(__FILE__, __LINE__, expr, " " __VA_ARGS__); \
		}                                                                       \
	} while (0)

#define cr_assert(c, ...) TSAN_CHECK(true, (c), #c, __VA_ARGS__)
#define cr_expect(c, ...) TSAN_CHECK(false, (c), #c, __VA_ARGS__)
#define cr_assert_not(c, ...) TSAN_CHECK(true, !(c), "!(" #c ")", __VA_ARGS__)
#define cr_expect_not(c, ...) TSAN_CHECK(false, !(c), "!(" #c ")", __VA_ARGS__)
#define TSAN_CMP(f, a, op, b, ...) TSAN_CHECK(f, (a) op (b), #a " " #op " " #b, __VA_ARGS__)
#define cr_assert_eq(a, b, ...) TSAN_CMP(true, a, ==, b, __VA_ARGS__)
#define cr_expect_eq(a, b, ...) TSAN_CMP(false, a, ==, b, __VA_ARGS__)
#define cr_assert_neq(a, b, ...) TSAN_CMP(true, a, !=, b, __VA_ARGS__)
#define cr_expect_neq(a, b, ...) TSAN_CMP(false, a, !=, b, __VA_ARGS__)
#define cr_assert_lt(a, b, ...) TSAN_CMP(true, a, <, b, __VA_ARGS__)
#define cr_expect_lt(a, b, ...) TSAN_CMP(false, a, <, b, __VA_ARGS__)
#define cr_assert_leq(a, b, ...) TSAN_CMP(true, a, <=, b, __VA_ARGS__)
#define cr_expect_leq(a, b, ...) TSAN_CMP(false, a, <=, b, __VA_ARGS__)
#define cr_assert_gt(a, b, ...) TSAN_CMP(true, a, >, b, __VA_ARGS__)
#define cr_expect_gt(a, b, ...) TSAN_CMP(false, a, >, b, __VA_ARGS__)
#define cr_assert_geq(a, b, ...) TSAN_CMP(true, a, >=, b, __VA_ARGS__)
#define cr_expect_geq(a, b, ...) TSAN_CMP(false, a, >=, b, __VA_ARGS__)
#define cr_assert_null(p, ...) TSAN_CHECK(true, (p) == NULL, #p " == NULL", __VA_ARGS__)
#define cr_expect_null(p, ...) TSAN_CHECK(false, (p) == NULL, #p " == NULL", __VA_ARGS__)
#define cr_assert_not_null(p, ...) TSAN_CHECK(true, (p) != NULL, #p " != NULL", __VA_ARGS__)
#define cr_expect_not_null(p, ...) TSAN_CHECK(false, (p) != NULL, #p " != NULL", __VA_ARGS__)
#define cr_assert_str_eq(a, b, ...) TSAN_CHECK(true, !strcmp((a), (b)), #a " == " #b, __VA_ARGS__)
#define cr_expect_str_eq(a, b, ...) TSAN_CHECK(false, !strcmp((a), (b)), #a " == " #b, __VA_ARGS__)
#define cr_assert_str_empty(a, ...) TSAN_CHECK(true, !(a)[0], #a " is empty", __VA_ARGS__)
#define cr_expect_str_empty(a, ...) TSAN_CHECK(false, !(a)[0], #a " is empty", __VA_ARGS__)
#define TSAN_FEQ(a, b, e) ((a) - (b) <= (e) && (b) - (a) <= (e))
#define cr_assert_float_eq(a, b, e, ...) TSAN_CHECK(true, TSAN_FEQ(a, b, e), #a " ~ " #b, __VA_ARGS__)
#define cr_expect_float_eq(a, b, e, ...) TSAN_CHECK(false, TSAN_FEQ(a, b, e), #a " ~ " #b, __VA_ARGS__)
#define cr_assert_arr_eq(a, b, n, ...) TSAN_CHECK(true, !memcmp((a), (b), (n)), #a " == " #b, __VA_ARGS__)
#define cr_expect_arr_eq(a, b, n, ...) TSAN_CHECK(false, !memcmp((a), (b), (n)), #a " == " #b, __VA_ARGS__)
#define cr_skip_test(...) tsan_skip(" " __VA_ARGS__)
#define cr_log_info(...) tsan_log("info", __VA_ARGS__)
#define cr_log_warn(...) tsan_log("warn", __VA_ARGS__)

#endif
