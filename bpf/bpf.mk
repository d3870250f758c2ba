# bpf/bpf.mk - build rules for the CO-RE eBPF programs (included by the
# top-level Makefile). Everything generated goes to $(B)/bpf/, so sanitizer
# builds (build-address-undefined/, ...) get their own copies:
#
#   $(B)/bpf/vmlinux.h        bpftool btf dump of the running kernel's BTF
#   $(B)/bpf/NAME.bpf.o       clang -target bpf, with BTF for maps and CO-RE
#   $(B)/bpf/NAME.skel.h      bpftool gen skeleton
#
# The loader objects include their skeleton as "bpf/NAME.skel.h" (found via
# -I$(B)) and depend on it. With BPF=0 none of this runs; the library then
# gets bpf/iotrace_none.c (every entry point says "built without eBPF
# support") and bpf/iotrace_stats.c (pure arithmetic) instead.

BPF_CFLAGS  ?= -g -O2 -target bpf -mcpu=v3 -D__TARGET_ARCH_$(if $(filter arm64,$(ARCH)),arm64,x86)
VMLINUX_BTF ?= /sys/kernel/btf/vmlinux

ifeq ($(BPF),1)
BPF_PROGS := $(patsubst bpf/%.bpf.c,%,$(wildcard bpf/*.bpf.c))
BPF_SKELS := $(BPF_PROGS:%=$(B)/bpf/%.skel.h)
.SECONDARY: $(BPF_PROGS:%=$(B)/bpf/%.bpf.o)

$(B)/bpf/vmlinux.h: | deps
	$(call msg,BTF,$@)
	$(Q)mkdir -p $(@D)
	$(Q)test -r $(VMLINUX_BTF) || { echo "bpf: $(VMLINUX_BTF) missing (kernel without BTF); build with BPF=0" >&2; exit 1; }
	$(Q)$(BPFTOOL) btf dump file $(VMLINUX_BTF) format c > $@

$(B)/bpf/%.bpf.o: bpf/%.bpf.c bpf/%.h $(B)/bpf/vmlinux.h | deps
	$(call msg,BPF,$@)
	$(Q)$(CLANG) $(BPF_CFLAGS) -I$(B)/bpf -Ibpf -c $< -o $@

$(B)/bpf/%.skel.h: $(B)/bpf/%.bpf.o
	$(call msg,SKEL,$@)
	$(Q)$(BPFTOOL) gen skeleton $< name $(subst .,_,$*)_bpf > $@

# Each loader includes its own skeleton; the command and the tests only use
# the public API but are ordered after it so a parallel build never races.
$(B)/bpf/iotrace.o: $(B)/bpf/iotrace.skel.h
$(B)/tools/trace.o $(B)/tests/test_bpf_iotrace.o: | $(BPF_SKELS)
else
$(B)/libnflash.a $(B)/libnflash.so: $(B)/bpf/iotrace_none.o $(B)/bpf/iotrace_stats.o
endif
