# nflash: one top-level Makefile.
#
#   make            build build/nflash, build/libnflash.a, build/libnflash.so
#   make test       build with -Werror and run the Criterion suite
#   make demo       the main job (see README.md)
#   make bench      build and run the benchmarks in bench/
#   make deps       apt-get install whatever Debian package is missing
#   make install PREFIX=/usr/local
#
# Options: V=1 (verbose), SANITIZE=address,undefined or SANITIZE=thread
# (objects go to build-<sanitizer>/), BPF=0 (no eBPF), WERROR=0,
# ARCH=arm64 (cross-build for aarch64 into build-arm64/ with Debian's
# aarch64-linux-gnu-gcc; `make test ARCH=arm64` runs the suite under
# qemu-aarch64-static; see README.md "On ARM64 devices").

.DELETE_ON_ERROR:
.SUFFIXES:

PREFIX   ?= /usr/local
V        ?= 0
WERROR   ?= 1
SANITIZE ?=
VERSION  := 0.1.0

ifeq ($(V),1)
Q :=
msg = @true
else
Q := @
msg = @printf '  %-7s %s\n' $(1) $(2)
endif

# ARCH: the target, x86_64 or arm64 (default: this machine). A target
# other than the host is a cross build: its own build directory, Debian's
# cross compiler, and tests run under qemu-user.
HOST_ARCH := $(patsubst aarch64,arm64,$(shell uname -m))
ARCH      ?= $(HOST_ARCH)
override ARCH := $(patsubst aarch64,arm64,$(patsubst amd64,x86_64,$(ARCH)))
ifeq ($(filter $(ARCH),x86_64 arm64),)
$(error ARCH=$(ARCH): only x86_64 and arm64 are supported)
endif
CROSS := $(if $(filter $(HOST_ARCH),$(ARCH)),,1)
BPF   ?= $(if $(CROSS),0,1)

comma := ,
B := build$(if $(CROSS),-$(ARCH))$(if $(SANITIZE),-$(subst $(comma),-,$(SANITIZE)))

ifneq ($(CROSS),)
ifeq ($(origin CC),default)
CC := aarch64-linux-gnu-gcc
endif
# eBPF needs the target kernel's BTF (vmlinux.h); a cross build has none of
# it, so BPF defaults to 0 there (BPF=1 VMLINUX_BTF=<a copy of the device's
# /sys/kernel/btf/vmlinux> builds it).
# The Criterion workers and the nflash binary the tests spawn run under
# qemu-user whether or not binfmt_misc knows aarch64 (tests/qemu_exec.c).
QEMU      ?= /usr/bin/qemu-aarch64-static
QEMU_CPU  ?= max
TEST_RUN  := env NF_QEMU=$(QEMU) QEMU_CPU=$(QEMU_CPU) $(QEMU)
# Criterion's arm64 runtime, unpacked by tools/deps.sh (see there why).
CRIT_ARM64 ?= /opt/nflash-arm64
CRIT_LIB   := $(CRIT_ARM64)/usr/lib/aarch64-linux-gnu
LDLIBS_TEST := -L$(CRIT_LIB) -l:libcriterion.so.3 -Wl,--disable-new-dtags,-rpath,$(CRIT_LIB) -Wl,-rpath-link,$(CRIT_LIB) -lcurl -ldl
else
LDLIBS_TEST := -lcriterion -lcurl
endif

CC      ?= cc
CLANG   ?= clang
BPFTOOL ?= bpftool

CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -O2 -g -fPIC -pthread \
	-Wall -Wextra -Wshadow -Wno-unused-parameter -Wstrict-prototypes \
	-Iinclude -I$(B) -MMD -MP -DNF_VERSION='"$(VERSION)"'
ifeq ($(WERROR),1)
CFLAGS_BASE += -Werror
endif
ifneq ($(SANITIZE),)
CFLAGS_BASE += -fsanitize=$(SANITIZE) -fno-omit-frame-pointer -fno-sanitize-recover=undefined
LDFLAGS_SAN := -fsanitize=$(SANITIZE)
endif
CFLAGS  ?=
CFLAGS  += $(CFLAGS_BASE)
LDLIBS  := -laio -luring -lnuma -lm -lpthread
# The command (tools/) alone: JSON reports and the server's HTTP.
TOOL_LDLIBS := -ljansson -lmicrohttpd

# Kernels for one ISA live in files named *_avx2.c / *_avx512.c (x86-64)
# and *_neon.c / *_neondot.c (arm64) and are chosen at start-up from the
# CPU's features; only those files get the ISA flags, and only the target's
# files are compiled.
ISA_AVX2    := -mavx2 -mfma -mf16c
ISA_AVX512  := -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16 -mavx2 -mfma -mf16c
ISA_NEON    := -march=armv8-a
ISA_NEONDOT := -march=armv8.2-a+dotprod
isa_flags = $(if $(findstring _avx512,$1),$(ISA_AVX512),$(if $(findstring _avx2,$1),$(ISA_AVX2),$(if \
	$(findstring _neondot,$1),$(ISA_NEONDOT),$(if $(findstring _neon,$1),$(ISA_NEON)))))
# (a name holding the other architecture's tag, e.g. kernels_avx2_kquant.c)
ISA_OTHER := $(if $(filter arm64,$(ARCH)),_avx,_neon)
drop_other_isa = $(foreach f,$1,$(if $(findstring $(ISA_OTHER),$(notdir $f)),,$f))

LIB_SRC := $(call drop_other_isa,$(sort $(wildcard storage/*.c compute/*.c planner/*.c)))
ifeq ($(BPF),1)
LIB_SRC += $(filter-out %.bpf.c,$(wildcard bpf/*.c))
LDLIBS  += -lbpf -lelf -lz
CFLAGS  += -DNF_HAVE_BPF=1
else
CFLAGS  += -DNF_HAVE_BPF=0
endif
TOOL_SRC  := $(sort $(wildcard tools/*.c))
TEST_SRC  := $(sort $(wildcard tests/test_*.c))
TESTUTIL_SRC := $(sort $(wildcard tests/util_*.c))
BENCH_SRC := $(sort $(wildcard bench/bench_*.c))

LIB_OBJ   := $(LIB_SRC:%.c=$(B)/%.o)
TOOL_OBJ  := $(TOOL_SRC:%.c=$(B)/%.o)
TEST_OBJ  := $(TEST_SRC:%.c=$(B)/%.o) $(TESTUTIL_SRC:%.c=$(B)/%.o)
BENCH_BIN := $(BENCH_SRC:bench/%.c=$(B)/bench/%)

# tools/ objects other than main() are reusable by tests and benches.
TOOL_LIB_OBJ := $(filter-out $(B)/tools/nflash.o,$(TOOL_OBJ))

.PHONY: all deps test test-run demo bench install clean
# deps runs before any compile (every compile, code generation and bench
# link has it as an order-only prerequisite): with -j2 a compile must not
# start before deps has installed the headers it needs on a fresh machine.
# The goals list their files directly, with no sub-make, so that
# `make -j2 all build/bench/bench_decode` builds libnflash.a once: a sub-make
# beside the top-level make once archived it twice at once and the link of
# build/nflash found no nf_strerror.
all: deps $(B)/nflash $(B)/libnflash.a $(B)/libnflash.so $(B)/nflash.pc

deps:
	$(Q)CI=$(CI) ARCH=$(ARCH) $(if $(CROSS),CRIT_ARM64=$(CRIT_ARM64)) sh tools/deps.sh

$(B)/%.o: %.c | deps
	$(call msg,CC,$@)
	$(Q)mkdir -p $(@D)
	$(Q)$(CC) $(CFLAGS) $(call isa_flags,$<) -c $< -o $@

$(B)/libnflash.a: $(LIB_OBJ)
	$(call msg,AR,$@)
	$(Q)rm -f $@ && ar rcs $@ $^

$(B)/libnflash.so: $(LIB_OBJ)
	$(call msg,LD,$@)
	$(Q)$(CC) -shared -Wl,-soname,libnflash.so.0 $(LDFLAGS_SAN) -o $@ $^ $(LDLIBS)

$(B)/nflash: $(TOOL_OBJ) $(B)/libnflash.a
	$(call msg,LD,$@)
	$(Q)$(CC) $(LDFLAGS_SAN) -o $@ $(TOOL_OBJ) $(B)/libnflash.a $(TOOL_LDLIBS) $(LDLIBS)

$(B)/nflash.pc: Makefile
	$(Q)mkdir -p $(@D)
	$(Q)printf 'prefix=%s\nlibdir=$${prefix}/lib\nincludedir=$${prefix}/include\n\nName: nflash\nDescription: LLM inference streaming FFN neurons from flash\nVersion: %s\nLibs: -L$${libdir} -lnflash\nLibs.private: %s\nCflags: -I$${includedir}\n' \
		'$(PREFIX)' '$(VERSION)' '$(LDLIBS)' > $@

# ---- eBPF ---------------------------------------------------------------
# (rules for bpf/*.bpf.c -> $(B)/bpf/*.skel.h live here; see bpf/)
-include bpf/bpf.mk

# ---- tests --------------------------------------------------------------
# A cross build links tests/qemu_exec.c into the test binary (its execve
# runs aarch64 programs through $NF_QEMU) and tells the tests which nflash
# binary to spawn.
ifneq ($(CROSS),)
TEST_OBJ += $(B)/tests/qemu_exec.o
$(TEST_OBJ): CFLAGS += -DNF_TEST_NFLASH='"$(B)/nflash"' -DNF_TEST_SLOWDOWN=10
endif
# Under ThreadSanitizer Criterion cannot start (Snaipe/Criterion#274): the
# same tests compile against tests/tsan/criterion/ and run under its own
# runner (each test forked, TEST_JOBS at a time, time limits scaled by
# NF_TSAN_SLOWDOWN, default 10; `make test SANITIZE=thread`).
ifneq ($(findstring thread,$(SANITIZE)),)
CFLAGS      += -Itests/tsan
TEST_RUNNER := $(B)/tests/tsan/runner.o
LDLIBS_TEST := -lcurl -ldl
export TSAN_OPTIONS ?= halt_on_error=0 second_deadlock_stack=1
else
TEST_RUNNER :=
endif
$(B)/tests/nflash-tests: $(TEST_OBJ) $(TEST_RUNNER) $(TOOL_LIB_OBJ) $(B)/libnflash.a
	$(call msg,LD,$@)
	$(Q)$(CC) $(LDFLAGS_SAN) -o $@ $(TEST_OBJ) $(TEST_RUNNER) $(TOOL_LIB_OBJ) $(B)/libnflash.a $(TOOL_LDLIBS) $(LDLIBS) $(LDLIBS_TEST)

# TEST_FILTER='storage/*' runs one suite; TEST_JOBS sets Criterion's workers.
# TEST_ISA=neon runs it with NFLASH_ISA forced (ARCH=arm64: QEMU_CPU=cortex-a57,
# a CPU without sdot, does the same for the dispatcher).
TEST_JOBS ?= 2
# Criterion's TAP report; a failing run ends by printing its failing tests
# with their assertions, so the tail of a CI log names them (the TSan
# runner, not Criterion's, writes none).
TEST_REPORT := $(B)/tests/report.tap
TEST_TAP    := $(if $(TEST_RUNNER),,--tap=$(TEST_REPORT))
test: deps $(B)/nflash $(B)/tests/nflash-tests
	$(Q)$(if $(TEST_ISA),NFLASH_ISA=$(TEST_ISA)) $(if $(findstring address,$(SANITIZE)),LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp:print_suppressions=0) $(TEST_RUN) $(B)/tests/nflash-tests -j$(TEST_JOBS) $(if $(TEST_FILTER),--filter='$(TEST_FILTER)') $(TEST_TAP) \
	  || { rc=$$?; $(if $(TEST_TAP),printf '\nnflash: the failing tests (whole report: %s):\n' '$(TEST_REPORT)' >&2; \
	       awk '/^not ok/ { p = 1 } /^(ok|#)/ { p = 0 } p' '$(TEST_REPORT)' >&2;) exit $$rc; }

# ---- the part of the suite CI runs under ThreadSanitizer -----------------
# (`make test-tsan-ci`; docs/KERNELS.md "Under ThreadSanitizer"): every test
# where threads meet: the I/O engine and its completion threads, the fault
# backend and the store's locks (storage), the thread pool, the neuron
# cache, attention streaming and the predictor on several threads
# (pipeline), and the server's 32-client load test (serve). The rest of
# the suite is model numerics on the same code paths; TSan slows its scalar
# reference kernels 10-16x, so the whole suite stays `make test
# SANITIZE=thread`, run by hand.
TSAN_CI_FILTER := @(storage/*|pool/*|serve/*|pipeline/@(cache_*|attn_stream_read_errors*|read_error*|predictor_*|batch_*|store_backed*|attn_streamed_equals_pinned*))
.PHONY: test-tsan-ci
test-tsan-ci:
	$(Q)$(MAKE) --no-print-directory test SANITIZE=thread TEST_FILTER='$(TSAN_CI_FILTER)'

# ---- nflash serve with real clients: curl's view of SSE, the OpenAI Node SDK
# (installed from npm into $(B)/openai-sdk; skipped with a reason without node)
.PHONY: test-server
test-server: deps $(B)/nflash
	$(Q)sh tests/server/run.sh $(B)

# ---- thread pool under ThreadSanitizer ----------------------------------
# Criterion cannot start under TSan (Snaipe/Criterion#274), so the pool's
# TSan run is a plain program: `make tsan-pool`.
.PHONY: tsan-pool
tsan-pool:
	$(call msg,CCLD,build-thread/stress_pool)
	$(Q)mkdir -p build-thread
	$(Q)$(CC) -std=c11 -D_GNU_SOURCE -O1 -g -fsanitize=thread -Iinclude tests/stress_pool.c \
		compute/pool.c -o build-thread/stress_pool -lnuma -lpthread
	$(Q)build-thread/stress_pool

# ---- benchmarks ---------------------------------------------------------
$(B)/bench/%: bench/%.c $(TOOL_LIB_OBJ) $(B)/libnflash.a | deps
	$(call msg,CCLD,$@)
	$(Q)mkdir -p $(@D)
	$(Q)$(CC) $(CFLAGS) -o $@ $< $(TOOL_LIB_OBJ) $(B)/libnflash.a $(TOOL_LDLIBS) $(LDLIBS)

bench: deps $(B)/nflash $(BENCH_BIN)
	$(Q)sh bench/run.sh $(B)

demo: deps $(B)/nflash
	$(Q)sh tools/demo.sh $(B)

# ---- make bench-decode: decode tokens/s under memory budgets vs mmap --------
# (bench/bench_decode_budget.sh: 7B-shaped synth model, ~8 GB of disk in
# NFLASH_BENCH_DIR, default $(B)/bench-data; needs root for the cgroup)
.PHONY: bench-decode
bench-decode: deps $(B)/nflash
	$(Q)sh bench/bench_decode_budget.sh $(B)

# ---- make bench-serve: nflash serve with 1-8 clients, batched vs one at a time --
# (bench/bench_serve.sh: the 7B store bench-decode builds, under 2 GiB)
.PHONY: bench-serve
bench-serve: deps $(B)/nflash
	$(Q)sh bench/bench_serve.sh $(B)

# ---- make bench-moe: a 47B Mixtral-shaped MoE under 4-12 GiB vs llama.cpp ----
# (bench/bench_moe.sh: ~50 GiB of disk in NFLASH_BENCH_DIR while a variant
# is built; LLAMA_CLI=/path/to/llama-cli for the peer; needs root)
.PHONY: bench-moe
bench-moe: deps $(B)/nflash
	$(Q)sh bench/bench_moe.sh $(B)

# ---- fuzzing: every format nflash reads (tests/fuzz/) ----------------------
# make fuzz [FUZZ_TIME=600]: libFuzzer + ASan + UBSan on one core, one target
# after the other, FUZZ_TIME seconds each: fuzz_gguf (the GGUF reader),
# fuzz_store (the store reader: superblocks, object table, permutations,
# bundle checksums, profile and plan sections), fuzz_model (model loading
# from a GGUF or a store), then fuzz_tok (make fuzz-tok). FUZZ_TARGETS picks
# some. Seeds are made fresh by fuzz_seeds (from ../shared/testdata and
# small generated stores and models) into build-fuzz/<target>/seeds, never
# committed; the grown corpus, log and any crash-* stay in build-fuzz/.
FUZZ_B       := build-fuzz
FUZZ_TIME    ?= 600
FUZZ_TARGETS ?= gguf store model tok
FUZZ_SAN     := -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_CFLAGS  := -std=c11 -D_GNU_SOURCE -O1 -g -Iinclude -I$(FUZZ_B) -DNF_HAVE_BPF=0 -DNF_VERSION='"$(VERSION)"'
FUZZ_SRC  := storage/gguf.c storage/dtype.c storage/dtype_kquant.c storage/error.c storage/io_sys.c storage/io_file.c
$(FUZZ_B)/fuzz_gguf: tests/fuzz/fuzz_gguf.c $(FUZZ_SRC) include/nflash/gguf.h
	$(call msg,FUZZ,$@)
	$(Q)mkdir -p $(@D)
	$(Q)$(CLANG) $(FUZZ_CFLAGS) -fsanitize=fuzzer $(FUZZ_SAN) -o $@ tests/fuzz/fuzz_gguf.c $(FUZZ_SRC) -laio -luring -lm
# The store and model targets link the library built with coverage and the
# sanitizers (per-ISA flags as in the main build).
FUZZ_LIB_SRC := $(call drop_other_isa,$(sort $(wildcard storage/*.c compute/*.c planner/*.c)))
FUZZ_LIB_OBJ := $(FUZZ_LIB_SRC:%.c=$(FUZZ_B)/obj/%.o)
.SECONDARY: $(FUZZ_LIB_OBJ)
# The per-ISA kernel files are compiled by $(CC), uninstrumented (clang 14
# refuses some of their intrinsics' arguments; they parse no input).
$(FUZZ_B)/obj/%.o: %.c
	$(call msg,FUZZCC,$@)
	$(Q)mkdir -p $(@D)
	$(Q)$(if $(findstring _avx,$<),$(CC) $(FUZZ_CFLAGS) -O2 -MMD -MP $(if $(findstring _avx512,$<),$(ISA_AVX512),$(ISA_AVX2)),$(CLANG) $(FUZZ_CFLAGS) -MMD -MP -fsanitize=fuzzer-no-link $(FUZZ_SAN)) -c $< -o $@
-include $(FUZZ_LIB_OBJ:.o=.d)
$(FUZZ_B)/fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/fuzz_fix.c tests/fuzz/fuzz_fix.h $(FUZZ_LIB_OBJ)
	$(call msg,FUZZ,$@)
	$(Q)$(CLANG) $(FUZZ_CFLAGS) -fsanitize=fuzzer $(FUZZ_SAN) -o $@ $< tests/fuzz/fuzz_fix.c $(FUZZ_LIB_OBJ) \
		-laio -luring -lnuma -lm -lpthread
$(FUZZ_B)/fuzz_seeds: tests/fuzz/fuzz_seeds.c $(B)/libnflash.a
	$(call msg,CCLD,$@)
	$(Q)mkdir -p $(@D)
	$(Q)$(CC) $(CFLAGS) -o $@ $< $(B)/libnflash.a $(LDLIBS)
# one target: make fuzz-run-T (seeds, then FUZZ_TIME seconds on one core)
FUZZ_MAXLEN_gguf  := 16384
FUZZ_MAXLEN_store := 65536
FUZZ_MAXLEN_model := 262144
.PHONY: fuzz fuzz-run-tok
fuzz: deps
	$(Q)$(MAKE) --no-print-directory $(B)/libnflash.a
	$(Q)for t in $(FUZZ_TARGETS); do $(MAKE) --no-print-directory fuzz-run-$$t || exit 1; done
fuzz-run-tok:
	$(Q)$(MAKE) --no-print-directory fuzz-tok
fuzz-run-%: $(FUZZ_B)/fuzz_% $(FUZZ_B)/fuzz_seeds
	$(Q)rm -rf $(FUZZ_B)/$*/seeds && mkdir -p $(FUZZ_B)/$*/seeds $(FUZZ_B)/$*/corpus
	$(Q)if [ $* = gguf ]; then $(FUZZ_B)/fuzz_seeds $(FUZZ_B)/$*/seeds ../shared/testdata/*/*.gguf; \
	else $(FUZZ_B)/fuzz_seeds --stores $(FUZZ_B)/$*/seeds; fi
	$(Q)if [ $* = store ]; then rm -f $(FUZZ_B)/$*/seeds/*.gguf; fi
	$(Q)cd $(FUZZ_B)/$* && ../fuzz_$* -jobs=1 -workers=1 -max_total_time=$(FUZZ_TIME) \
		-max_len=$(FUZZ_MAXLEN_$*) -timeout=10 -rss_limit_mb=4096 corpus seeds; \
		s=$$?; tail -n 15 fuzz-0.log; exit $$s

# make fuzz-tok [FUZZ_TIME=600]: the tokenizers on arbitrary text, one core.
TOK_FUZZ_SRC := $(FUZZ_SRC) $(wildcard compute/tok*.c) compute/unicode_tables.c
$(FUZZ_B)/fuzz_tok: tests/fuzz/fuzz_tok.c $(TOK_FUZZ_SRC) include/nflash/tokenizer.h compute/tok_int.h
	$(call msg,FUZZ,$@)
	$(Q)mkdir -p $(@D)
	$(Q)$(CLANG) -std=c11 -D_GNU_SOURCE -O1 -g -Iinclude -fsanitize=fuzzer,address,undefined \
		-fno-sanitize-recover=undefined -o $@ tests/fuzz/fuzz_tok.c $(TOK_FUZZ_SRC) -laio -luring -lm
.PHONY: fuzz-tok
fuzz-tok: $(FUZZ_B)/fuzz_tok
	$(Q)rm -rf $(FUZZ_B)/tok/seeds && mkdir -p $(FUZZ_B)/tok/corpus $(FUZZ_B)/tok/seeds
	$(Q)cp ../shared/testdata/vocab/*.inp $(FUZZ_B)/tok/seeds/
	$(Q)cd $(FUZZ_B)/tok && NF_FUZZ_VOCAB=$(abspath ../shared/testdata/vocab) ../fuzz_tok -jobs=1 -workers=1 \
		-max_total_time=$(FUZZ_TIME) -max_len=512 -timeout=10 corpus seeds; \
		s=$$?; tail -n 15 fuzz-0.log; exit $$s

# ---- install ------------------------------------------------------------
install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/include/nflash
	install -m 755 $(B)/nflash $(DESTDIR)$(PREFIX)/bin/
	install -m 644 $(B)/libnflash.a $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(B)/libnflash.so $(DESTDIR)$(PREFIX)/lib/libnflash.so.0
	ln -sf libnflash.so.0 $(DESTDIR)$(PREFIX)/lib/libnflash.so
	install -m 644 include/nflash/*.h $(DESTDIR)$(PREFIX)/include/nflash/
	install -m 644 $(B)/nflash.pc $(DESTDIR)$(PREFIX)/lib/pkgconfig/

clean:
	rm -rf build build-*

-include $(shell find $(B) -name '*.d' 2>/dev/null)
