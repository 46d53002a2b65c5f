"""ptx_load_depth: the global loads a kernel's data loads wait for, read from PTX.

Small hand-written functions pin each rule (a load that feeds an address, a branch that guards
a block, a loop's back edge, parallel loads); the previous revision of the patched DeepSeek
kernel (its PTX kept in fixtures/, compiled for sm_103a with FlashInfer's JIT flags) is the
real case the rules were written for: its MN-limit load waited for the padded total, so its
data loads are three deep where the pristine kernel's are two. The current kernels are checked
against pristine in test_activation_compile.py."""
from __future__ import annotations

from pathlib import Path

from tests.flashinfer import ptx_load_depth as pld

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def body(*lines: str) -> str:
    return "{\n" + "\n".join(lines) + "\n}\n"


def test_an_address_from_a_load_is_one_deeper():
    ptx = body("ld.param.u64 %rd1, [p];", "ld.global.u32 %r1, [%rd1];", "mul.wide.s32 %rd2, %r1, 16;",
               "add.s64 %rd3, %rd1, %rd2;", "ld.global.v4.u32 {%r2, %r3, %r4, %r5}, [%rd3];", "ret;")
    loads = pld.load_depths(ptx)
    assert [(load.depth, load.is_data) for load in loads] == [(1, False), (2, True)]


def test_parallel_loads_add_no_depth():
    ptx = body("ld.global.u32 %r1, [%rd1];", "ld.global.u32 %r2, [%rd2];", "add.s32 %r3, %r1, %r2;",
               "mul.wide.s32 %rd3, %r3, 16;", "ld.global.v4.u32 {%r4, %r5, %r6, %r7}, [%rd3];", "ret;")
    assert pld.data_load_depth(ptx) == 2


def test_a_branch_on_a_loaded_value_guards_its_block():
    """The old kernel's shape: the loop bound is the loaded total, so the index load waits."""
    ptx = body("ld.global.u32 %r1, [%rd1];", "setp.ge.s32 %p1, %r2, %r1;", "@%p1 bra $L__EXIT;",
               "ld.global.u32 %r3, [%rd2];", "setp.eq.s32 %p2, %r3, -1;", "@%p2 bra $L__EXIT;",
               "ld.global.v4.u32 {%r4, %r5, %r6, %r7}, [%rd3];", "$L__EXIT:", "ret;")
    assert [load.depth for load in pld.load_depths(ptx)] == [1, 2, 3]


def test_a_block_after_the_join_is_not_guarded():
    ptx = body("ld.global.u32 %r1, [%rd1];", "setp.eq.s32 %p1, %r1, 0;", "@%p1 bra $L__JOIN;",
               "add.s32 %r2, %r2, 1;", "$L__JOIN:", "ld.global.u8 %rs1, [%rd2];", "ret;")
    assert pld.data_load_depth(ptx) == 1


def test_a_loop_back_edge_is_the_first_pass_only():
    """A load in a loop body that feeds the next iteration's branch adds nothing to the first pass."""
    ptx = body("mov.u32 %r1, 0;", "$L__LOOP:", "ld.global.u32 %r2, [%rd1];", "setp.eq.s32 %p1, %r2, 0;",
               "@%p1 bra $L__LOOP;", "ld.global.v2.u32 {%r3, %r4}, [%rd2];", "ret;")
    assert pld.data_load_depth(ptx) == 2  # guarded by the one load of the first pass


def test_what_counts_as_data():
    assert pld.is_data_load("ld.global.u8") and pld.is_data_load("ld.global.nc.v4.u32")
    assert pld.is_data_load("ld.global.u16") and not pld.is_data_load("ld.global.f32")
    assert not pld.is_data_load("ld.global.u32") and not pld.is_data_load("ld.global.nc.u64")


def test_the_previous_revision_waited_for_the_total():
    ptx = (FIXTURES / "previous_deepseek_e4m3_sm_103a.ptx").read_text()
    assert "activationDeepSeekKernel" in ptx.splitlines()[0]
    assert pld.data_load_depth(ptx) == 3
