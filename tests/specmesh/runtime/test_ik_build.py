"""The row-invariant ik_llama.cpp build (specmesh/runtime/ik_build.py): the source patch, which library the binding is
pointed at, and the command's report. The build itself is what `make setup` runs; that it happened and is what the
engine loads is tested in tests/specmesh/runtime/test_ik_engine.py, what it computes in tests/test_real_ik.py."""

from __future__ import annotations

import json

import pytest

from specmesh.runtime import ik_build

STALE_STANDIN = ("// flash attention kernels\n#if defined IQK_IMPLEMENT && defined GGML_IQK_FLASH_ATTENTION\n"
                 "bool iqk_flash_attn_noalibi(int a) { return true; }\n"
                 "#else\n\nbool iqk_flash_attn_noalibi(int type_q, int type_mask) {\n    return false;\n}\n\n#endif\n")


def fake_source(root, branches: int):
    kernels = root / "ggml/src/iqk"
    kernels.mkdir(parents=True)
    body = "\n".join(f"    if constexpr (nrc_y == 1) {{ one_row_{i}(); }} else {{ rows_{i}(); }}" for i in range(branches))
    (kernels / "iqk_gemm_kquants.cpp").write_text(
        f"template <int nrc_y>\nstatic void mul_mat_q4_k_r4_q8_k(int n) {{\n{body}\n}}\n\n"
        "template <typename Dequantizer, int nrc_y>\nstatic void mul_mat_qX_K_q8_2_X4_T(int n) {\n"
        "    if constexpr (nrc_y == 1) { plain_one_row(); }\n}\n")  # a plain layout's: its one row needs it
    (kernels / "iqk_gemm_legacy_quants.cpp").write_text(
        "template <int nrc_y>\ninline void process_min_r4_b32(int ibl) {\n    if constexpr (nrc_y == 1) {}\n}\n")
    (kernels / "iqk_mul_mat.cpp").write_text("void mul_mat_q8_0_r8(int n) { if constexpr (nrc_y == 1) {} }\n")  # not a kernel file
    (kernels / "iqk_flash_attn.cpp").write_text(STALE_STANDIN)
    return root


def test_the_patch_turns_every_one_row_branch_off_and_replaces_the_stale_stand_ins(tmp_path, monkeypatch):
    monkeypatch.setattr(ik_build, "ONE_ROW_BRANCHES", 4)
    source = fake_source(tmp_path, 3)
    assert ik_build.patch_source(source) == 4
    kernels = source / "ggml/src/iqk"
    repacked = (kernels / "iqk_gemm_kquants.cpp").read_text()
    assert repacked.count("if constexpr (false && nrc_y == 1) { one_row_") == 3
    assert "if constexpr (nrc_y == 1) { plain_one_row(); }" in repacked  # the plain kernel's branch stays
    assert "if constexpr (false && nrc_y == 1) {}" in (kernels / "iqk_gemm_legacy_quants.cpp").read_text()
    assert "if constexpr (nrc_y == 1)" in (kernels / "iqk_mul_mat.cpp").read_text()
    attention = (kernels / "iqk_flash_attn.cpp").read_text()
    assert attention.startswith(STALE_STANDIN[:STALE_STANDIN.index("#else")])  # the real kernels' branch untouched
    assert "size_t iqk_fa_work_buffer_size(const struct ggml_tensor *, int) { return 0; }" in attention
    assert "int type_q, int type_mask" not in attention  # the stale signature is gone, the header's is there
    assert "const void *, const void *, const void *, const void *, const void *, float, float," in attention
    assert attention.rstrip().endswith("#endif")


def test_another_source_is_refused_untouched(tmp_path, monkeypatch):
    monkeypatch.setattr(ik_build, "ONE_ROW_BRANCHES", 83)
    source = fake_source(tmp_path, 3)
    before = (source / "ggml/src/iqk/iqk_gemm_kquants.cpp").read_text()
    with pytest.raises(RuntimeError, match="4 one-row branches in repacked kernels, expected 83"):
        ik_build.patch_source(source)
    assert (source / "ggml/src/iqk/iqk_gemm_kquants.cpp").read_text() == before

    monkeypatch.setattr(ik_build, "ONE_ROW_BRANCHES", 4)
    (source / "ggml/src/iqk/iqk_flash_attn.cpp").write_text("#endif\n")  # no stale stand-in: another version
    with pytest.raises(RuntimeError, match="not the ik-llama-cpp-python 0.1.5 source"):
        ik_build.patch_source(source)
    assert (source / "ggml/src/iqk/iqk_gemm_kquants.cpp").read_text() == before


def install(prefix) -> None:
    directory = ik_build.install_dir(prefix)
    directory.mkdir(parents=True)
    for name in ik_build.LIBRARIES:
        (directory / name).write_bytes(b"\x7fELF")
    (directory / ik_build.RECORD).write_text(json.dumps({"compile_s": 99.0, "one_row_branches_off": 83}))


def test_the_build_is_installed_once_complete_and_the_wheel_can_be_asked_for(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ik_build.sys, "prefix", str(tmp_path))
    monkeypatch.delenv(ik_build.SELECT_ENV, raising=False)
    assert ik_build.installed_library() is None
    assert ik_build.main(["--check"]) == 1
    assert "no row-invariant build" in capsys.readouterr().out

    install(tmp_path)
    assert ik_build.installed_library() == ik_build.install_dir() / "libllama.so" and not ik_build.wheel_requested()
    assert ik_build.record()["compile_s"] == 99.0
    assert ik_build.main([]) == 0  # installed: nothing to build
    assert "row-invariant build installed" in capsys.readouterr().out
    monkeypatch.setenv(ik_build.SELECT_ENV, "wheel")
    assert ik_build.wheel_requested() and ik_build.installed_library() is not None

    (ik_build.install_dir() / "libggml.so").unlink()  # a partial install is no install
    monkeypatch.delenv(ik_build.SELECT_ENV)
    assert ik_build.installed_library() is None


def test_a_failed_build_says_why_and_leaves_nothing_installed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ik_build.sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ik_build.shutil, "which", lambda tool: None if tool == "cmake" else f"/usr/bin/{tool}")
    assert ik_build.main([]) == 1
    err = capsys.readouterr().err
    assert "row-invariant build failed, the engine runs the wheel's library" in err and "no cmake on PATH" in err
    assert ik_build.installed_library() is None and not ik_build.install_dir().exists()


def test_the_binding_points_the_package_at_the_build_or_away_from_it(tmp_path, monkeypatch):
    """What ik_binding does before the package loads its library: set IK_LLAMA_CPP_LIB_PATH to the build, keep a
    path the user chose, and drop an inherited path to the build where the wheel is asked for."""
    from specmesh.runtime import ik_binding

    monkeypatch.setattr(ik_build.sys, "prefix", str(tmp_path))
    install(tmp_path)
    built = str(ik_build.install_dir() / "libllama.so")
    monkeypatch.delitem(ik_binding.sys.modules, "ik_llama_cpp._ctypes_api", raising=False)
    monkeypatch.delenv(ik_build.SELECT_ENV, raising=False)

    monkeypatch.delenv("IK_LLAMA_CPP_LIB_PATH", raising=False)
    assert ik_binding._select_library() and ik_binding.os.environ["IK_LLAMA_CPP_LIB_PATH"] == built

    monkeypatch.setenv("IK_LLAMA_CPP_LIB_PATH", "/opt/mine/libllama.so")
    assert not ik_binding._select_library()
    assert ik_binding.os.environ["IK_LLAMA_CPP_LIB_PATH"] == "/opt/mine/libllama.so"

    monkeypatch.setenv("IK_LLAMA_CPP_LIB_PATH", built)
    monkeypatch.setenv(ik_build.SELECT_ENV, "wheel")
    assert not ik_binding._select_library() and "IK_LLAMA_CPP_LIB_PATH" not in ik_binding.os.environ
