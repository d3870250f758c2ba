/*
 * tests/tsan/criterion/redirect.h - Criterion's stdout/stderr capture for
 * the TSan build (see criterion.h beside it): the stream goes to a
 * temporary file; the getters return a reader from its start.
 */
#ifndef NFLASH_TSAN_REDIRECT_H
#define NFLASH_TSAN_REDIRECT_H

#include <stdio.h>

#include "criterion.h"

void cr_redirect_stdout(void);
void cr_redirect_stderr(void);
FILE *cr_get_redirected_stdout(void);
FILE *cr_get_redirected_stderr(void);
bool tsan_stream_eq(int fd, const char *want);

#define cr_assert_stdout_eq_str(s, ...) TSAN_CHECK(true, tsan_stream_eq(1, (s)), "stdout == " #s, __VA_ARGS__)
#define cr_expect_stdout_eq_str(s, ...) TSAN_CHECK(false, tsan_stream_eq(1, (s)), "stdout == " #s, __VA_ARGS__)
#define cr_assert_stderr_eq_str(s, ...) TSAN_CHECK(true, tsan_stream_eq(2, (s)), "stderr == " #s, __VA_ARGS__)
#define cr_expect_stderr_eq_str(s, ...) TSAN_CHECK(false, tsan_stream_eq(2, (s)), "stderr == " #s, __VA_ARGS__)

#endif
