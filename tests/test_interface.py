"""One source of truth: wit/symphony.wit against the host's error table and the C SDK."""
import re
from pathlib import Path

import pytest

from symphony_os.errors import ErrorCode
from symphony_os.wasm.wit import component_signatures, read_wit

ROOT = Path(__file__).resolve().parent.parent
HEADER = (ROOT / "guest_sdk" / "c" / "symphony.h").read_text()


def test_error_table_matches_wit():
    _, cases = read_wit()
    assert [c.replace("-", "_").upper() for c in cases] == [e.name for e in ErrorCode]
    assert [e.value for e in ErrorCode] == list(range(-1, -len(cases) - 1, -1))


def test_c_header_error_codes_match_wit():
    _, cases = read_wit()
    defined = re.findall(r"#define SYM_E\w+ (-\d+)\s+/\* ([\w-]+) \*/", HEADER)
    assert [(int(v), name) for v, name in defined] == [(-(i + 1), c) for i, c in enumerate(cases)]


def test_c_header_imports_match_wit():
    functions, _ = read_wit()
    imports = {name: params for name, params in
               re.findall(r"SYM_IMPORT\((\w+)\) int32_t __sym_\w+\(([^)]*)\);", HEADER)}
    assert set(imports) == {f.core_name for f in functions}
    for f in functions:
        params = [p for p in imports[f.core_name].split(",") if p.strip() and p.strip() != "void"]
        assert len(params) == len(f.params), f"{f.core_name}: header has {params}, WIT has {f.params}"


RUST = (ROOT / "guest_sdk" / "rust" / "symphony.rs").read_text()
ASSEMBLYSCRIPT = (ROOT / "guest_sdk" / "assemblyscript" / "symphony.ts").read_text()


def _camel(kebab: str) -> str:
    return "".join(part.capitalize() for part in kebab.split("-"))


def test_rust_imports_match_wit():
    functions, _ = read_wit()
    block = RUST[RUST.index('#[link(wasm_import_module = "symphony")]'):]
    block = block[:block.index("\n    }\n")]
    imports = dict(re.findall(r"pub fn (\w+)\(([^)]*)\) -> i32;", block))
    assert set(imports) == {f.core_name for f in functions}
    for f in functions:
        names = [p.split(":")[0].strip() for p in imports[f.core_name].split(",") if p.strip()]
        assert names == [p.replace("-", "_") for p in f.params], f.core_name


def test_rust_error_codes_match_wit():
    _, cases = read_wit()
    variants = re.findall(r"^\s+(\w+) = (-\d+),$", RUST, re.M)
    assert variants == [(_camel(c), str(-(i + 1))) for i, c in enumerate(cases)]
    table = re.search(r"const ERRORS: \[Error; (\d+)\] = \[(.*?)\];", RUST, re.S)
    assert int(table.group(1)) == len(cases)
    assert re.findall(r"Error::(\w+)", table.group(2)) == [_camel(c) for c in cases]


def test_assemblyscript_imports_match_wit():
    functions, _ = read_wit()
    imports = {name: (declared, params) for name, declared, params in re.findall(
        r'@external\("symphony", "(\w+)"\) export declare function (\w+)\(([^)]*)\): i32;', ASSEMBLYSCRIPT)}
    assert set(imports) == {f.core_name for f in functions}
    for f in functions:
        declared, params = imports[f.core_name]
        names = [p.split(":")[0].strip() for p in params.split(",") if p.strip()]
        assert declared == f.core_name and names == [p.replace("-", "_") for p in f.params], f.core_name


def test_assemblyscript_error_codes_match_wit():
    _, cases = read_wit()
    enum = ASSEMBLYSCRIPT[ASSEMBLYSCRIPT.index("export enum ErrorCode"):]
    enum = enum[:enum.index("}")]
    assert re.findall(r"(\w+) = (-\d+),", enum) == [(_camel(c), str(-(i + 1))) for i, c in enumerate(cases)]
    names = re.search(r"const ERROR_NAMES: string\[\] = \[(.*?)\];", ASSEMBLYSCRIPT, re.S).group(1)
    assert re.findall(r'"([\w-]+)"', names) == cases



# ---- the constants each SDK copies: pred kinds, kv-open and kv-hint flags, the sampling record ----

PYTHON_SDK = (ROOT / "guest_sdk" / "python" / "symphony.py").read_text()
PYTHON_WIT = (ROOT / "guest_sdk" / "python" / "wit" / "symphony.wit").read_text()


def _host_constants() -> dict[str, int]:
    from symphony_os.kv.kvfs import OpenFlags
    from symphony_os.lip import core_abi

    return {"PRED_DIST": core_abi.KIND_DISTRIBUTION, "PRED_TOPK": core_abi.KIND_TOPK,
            "PRED_SAMPLE": core_abi.KIND_SAMPLE, "PRED_GREEDY_EACH": core_abi.KIND_GREEDY_EACH,
            "PRED_SCORE_EACH": core_abi.KIND_SCORE_EACH,
            "KV_CREATE": OpenFlags.CREATE, "KV_EXCLUSIVE": OpenFlags.EXCLUSIVE, "KV_READ_ONLY": OpenFlags.READ_ONLY,
            "HINT_PINNED": 1, "HINT_DROP_ON_CLOSE": 2,
            "SAMPLING_SEED": core_abi.SAMPLING_SEED, "SAMPLING_MORE": core_abi.SAMPLING_MORE_FOLLOWS}


def test_sdk_constants_match_the_host():
    expected = _host_constants()
    assert list(expected.values())[:5] == [0, 1, 2, 3, 4]
    c = {name: int(value) for name, value in re.findall(r"#define SYM_(\w+) (\d+)\n", HEADER)}
    rust = {name: int(value) for name, value in re.findall(r"const (\w+): i32 = (\d+);", RUST)}
    assemblyscript = {name: int(value) for name, value in re.findall(r"const (\w+): i32 = (\d+);", ASSEMBLYSCRIPT)}
    for sdk in (c, rust, assemblyscript):
        assert {name: sdk.get(name) for name in expected} == expected
    # The Python world: `want` cases in kind order, and the SDK's flag values.
    cases = re.search(r"variant want \{(.*?)\}", PYTHON_WIT, re.S).group(1)
    assert re.findall(r"([\w-]+)[(,]", cases) == ["distribution", "top-k", "sample", "greedy-each", "score-each"]
    assert re.search(r"CREATE, EXCLUSIVE, READ_ONLY = (\d+), (\d+), (\d+)", PYTHON_SDK).groups() == ("1", "2", "4")
    assert re.search(r"PINNED, DROP_ON_CLOSE = (\d+), (\d+)", PYTHON_SDK).groups() == ("1", "2")
    # What the WIT documents.
    wit = (ROOT / "wit" / "symphony.wit").read_text()
    assert "flags: 1 create, 2 exclusive, 4 read-only" in wit and "flags: 1 pinned, 2 drop on close" in wit


def test_sampling_record_layout_is_the_same_in_every_sdk():
    """The host's struct format, C's field order, Rust's #[repr(C)] struct, AssemblyScript's
    offsets; with the 24-byte record that may follow (C's sym_sampling_more), which Rust's and
    AssemblyScript's records always carry."""
    from symphony_os.lip.core_abi import SAMPLING_MORE, SAMPLING_RECORD

    assert SAMPLING_RECORD.format == "<ffiiQiiiiii" and SAMPLING_RECORD.size == 48
    assert SAMPLING_MORE.format == "<ffiiii" and SAMPLING_MORE.size == 24
    more = ["min_p", "repetition_penalty", "penalized", "n_penalized", "logprobs", "top_logprobs"]
    fields = ["temperature", "top_p", "top_k", "has_seed", "seed", "allowed", "n_allowed", "bias_ids",
              "bias_values", "n_bias", "grammar"] + more
    sizes = [4, 4, 4, 4, 8, 4, 4, 4, 4, 4, 4] + [4] * len(more)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    struct_c = HEADER[HEADER.index("typedef struct sym_sampling {"):HEADER.index("} sym_sampling;")]
    assert re.findall(r"\*?(\w+);", struct_c) == fields[:-len(more)]
    struct_c = HEADER[HEADER.index("typedef struct sym_sampling_more {"):HEADER.index("} sym_sampling_more;")]
    assert re.findall(r"\*?(\w+);", struct_c) == more
    struct_rust = RUST[RUST.index("struct SamplingRecord {"):]
    struct_rust = struct_rust[:struct_rust.index("}")]
    assert re.findall(r"(\w+): [iuf](?:32|64),", struct_rust) == fields
    assert re.findall(r"(\w+): ([iuf]\d+),", struct_rust)[4][1] == "u64"
    record = ASSEMBLYSCRIPT[ASSEMBLYSCRIPT.index("export class Sampling"):]
    record = record[:record.index("\n  }\n")]
    stores = re.findall(r"store<(\w+)>\(p, [^;]*?(?:, (\d+))?\);", record)
    assert [int(offset or 0) for _, offset in stores] == offsets
    assert [kind for kind, _ in stores][4] == "u64"


def test_the_component_wit_reader_writes_named_types_out_and_refuses_what_it_does_not_know(tmp_path):
    interfaces = """package t:t@0.1.0;
interface errors {
  enum error-code { bad, worse, }
}
interface things {
  use errors.{error-code};
  /* a block comment, and %-escaped names */
  resource %thing {
    %size: func() -> u32;
  }
  record pair { %first: s32, second: list<tuple<s32, f32>>, }
  look: func(t: borrow<thing>, p: option<pair>) -> result<thing, error-code>;
  drop-it: func(%flags: s32);
}
"""
    good, broken = tmp_path / "good.wit", tmp_path / "broken.wit"
    good.write_text(interfaces)
    broken.write_text(interfaces + "interface broken {\n  odd: func(x: mystery) -> u8;\n}\n")
    assert component_signatures(good) == {
        "things.[method]thing.size": "(borrow<thing>) -> u32",
        "things.look": "(borrow<thing>, option<record{first: s32, second: list<tuple<s32, f32>>}>) -> "
                       "result<own<thing>, enum{bad, worse}>",
        "things.drop-it": "(s32)",
    }
    with pytest.raises(ValueError, match="type 'mystery' is not one this reader knows"):
        component_signatures(broken)


def test_the_core_abi_serves_every_call_of_the_wit_with_its_arity():
    """Programs are checked against the WIT's call table and linked to CoreCalls' methods, one
    per call, each taking the guest memory and the WIT's parameters."""
    from symphony_os.lip.core_abi import CoreCalls

    functions, _ = read_wit()
    for function in functions:
        method = getattr(CoreCalls, function.core_name, None)
        assert method is not None, function.core_name
        assert method.__code__.co_argcount - 2 == len(function.params), function.core_name
