/*
 * test_tools_cli.c - flag parsers and the JSON writer used by every command.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/error.h"
#include "../tools/cli.h"

Test(tools, size_suffixes)
{
	uint64_t v;
	cr_assert_eq(nf_cli_size("--x", "4096", &v), 0);
	cr_assert_eq(v, 4096);
	cr_assert_eq(nf_cli_size("--x", "64K", &v), 0);
	cr_assert_eq(v, 65536);
	cr_assert_eq(nf_cli_size("--x", "1.5G", &v), 0);
	cr_assert_eq(v, 1536ull << 20);
	cr_assert_eq(nf_cli_size("--x", "2GiB", &v), 0);
	cr_assert_eq(v, 2ull << 30);
	cr_assert_eq(nf_cli_size("--x", "12Q", &v), NF_EUSAGE);
	cr_assert_eq(nf_cli_size("--x", "-1", &v), NF_EUSAGE);
	cr_assert_eq(nf_cli_size("--x", "", &v), NF_EUSAGE);
}

Test(tools, ids)
{
	int32_t *ids = NULL;
	size_t n = 0;
	cr_assert_eq(nf_cli_ids("--ids", "1,278,263", &ids, &n), 0);
	cr_assert_eq(n, 3);
	cr_assert_eq(ids[1], 278);
	free(ids);
	cr_assert_eq(nf_cli_ids("--ids", "1,x", &ids, &n), NF_EUSAGE);
	cr_assert_eq(nf_cli_ids("--ids", "", &ids, &n), NF_EUSAGE);
}

Test(tools, json_escapes)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	struct nf_json j;
	nf_json_init(&j, f, false);
	nf_json_obj_begin(&j, NULL);
	nf_json_str(&j, "a", "q\"\n");
	nf_json_arr_begin(&j, "b");
	nf_json_u64(&j, NULL, 1);
	nf_json_dbl(&j, NULL, 0.0 / 0.0);
	nf_json_arr_end(&j);
	nf_json_obj_end(&j);
	fclose(f);
	cr_assert_str_eq(buf, "{\"a\":\"q\\\"\\n\",\"b\":[1,null]}");
	free(buf);
}

Test(tools, strerror_ranges)
{
	cr_assert_str_eq(nf_strerror(NF_ECHECKSUM), "checksum mismatch");
	cr_assert(strlen(nf_strerror(-5)) > 0);
	cr_assert_str_eq(nf_strerror(-(NF_E_BASE + 999)), "unknown nflash error");
	struct nf_diag d = {0};
	cr_assert_eq(nf_diag_fail(&d, NF_EFORMAT, "field %s", "x"), NF_EFORMAT);
	nf_diag_fail(&d, NF_EMAGIC, "second");
	cr_assert_str_eq(d.msg, "field x");
	cr_assert_eq(nf_diag_fail(NULL, NF_EMAGIC, "ok"), NF_EMAGIC);
}
