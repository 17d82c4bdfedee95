"""`sandboxd new`: the scaffold, its refusals, and that it is a valid tool as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxd.cli.main import main
from sandboxd.dev.lint.validation import validate_paths
from sandboxd.tools.discovery import inspect_tool_dir
from sandboxd.dev.scaffold import ScaffoldError, label_for, scaffold_tool
from sandboxd.tools.schema import validate_arguments


pytestmark = pytest.mark.usefixtures("isolated_config")

def test_scaffold_writes_a_manifest_and_a_typed_entry(tmp_path: Path) -> None:
    files = scaffold_tool("weather", tmp_path)
    assert files == [tmp_path / "weather" / "TOOL.md", tmp_path / "weather" / "index.ts"]
    manifest, entry = (path.read_text() for path in files)
    assert manifest.startswith("---\nname: weather\nlabel: Weather\n") and "\nversion: 1\n" in manifest
    for section in ("# Weather", "## Usage", "## Examples", "## Error Handling", "## Notes"):
        assert f"\n{section}\n" in manifest
    for part in ("type Params = {", "function ok(text: string): ToolResult", "function err(text: string): ToolResult",
                 "export async function execute(", "try {", "} catch (e) {", "onUpdate?.("):
        assert part in entry


def test_the_scaffold_validates_with_no_findings(tmp_path: Path) -> None:
    scaffold_tool("weather", tmp_path)
    assert validate_paths([tmp_path / "weather"], data_path=tmp_path / "data") == []


def test_the_scaffold_is_a_tool_with_an_example_input(tmp_path: Path) -> None:
    scaffold_tool("weather", tmp_path)
    tool, problems = inspect_tool_dir(tmp_path / "weather", tmp_path, "user")
    assert tool is not None and problems == []
    assert tool.schema["required"] == []
    assert validate_arguments(tool.schema, {"city": "Rome"}) == {"city": "Rome"}
    # `sandboxd run NAME` with no arguments works the first time: the example input has a default.
    assert validate_arguments(tool.schema, {}) == {"city": "Paris"}



@pytest.mark.parametrize("name", ["web_search", "a", "ocr2", "x" * 64])
def test_snake_case_names_make_matching_labels(tmp_path: Path, name: str) -> None:
    scaffold_tool(name, tmp_path)
    assert f"\nname: {name}\nlabel: {label_for(name)}\n" in (tmp_path / name / "TOOL.md").read_text()
    assert validate_paths([tmp_path / name]) == []


def test_label_for() -> None:
    assert (label_for("web_search"), label_for("ocr2"), label_for("a__b")) == ("Web Search", "Ocr2", "A B")


@pytest.mark.parametrize(("name", "suggestion"), [
    ("Weather", "weather"), ("web-search", "web_search"), ("WebSearch", "web_search"), ("2fa", "tool_2fa"),
    ("my tool", "my_tool"), ("_private", "private"),
])
def test_names_that_are_not_snake_case_are_refused_with_a_spelling(tmp_path: Path, name: str, suggestion: str) -> None:
    with pytest.raises(ScaffoldError, match=f"try: sandboxd new {suggestion}$"):
        scaffold_tool(name, tmp_path / "tools")
    assert not (tmp_path / "tools").exists()


def test_too_long_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ScaffoldError, match="at most 64"):
        scaffold_tool("x" * 65, tmp_path)


@pytest.mark.parametrize("kind", ["dir", "file", "dangling-link"])
def test_an_existing_folder_is_never_touched(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "weather"
    if kind == "dir":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    elif kind == "file":
        target.write_text("mine")
    else:
        target.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ScaffoldError, match="already exists"):
        scaffold_tool("weather", tmp_path)
    if kind == "dir":
        assert [p.name for p in target.iterdir()] == ["notes.txt"]
    elif kind == "file":
        assert target.read_text() == "mine"
    else:
        assert target.is_symlink() and not (tmp_path / "nowhere").exists()


def test_cli_new_then_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["new", "weather"]) == 0
    out = capsys.readouterr().out
    # The next step needs no arguments: the scaffold's example input has a default.
    assert out.splitlines() == ["created weather/TOOL.md", "created weather/index.ts",
                                "next: sandboxd run weather    (it runs as it is; then make it yours: rename the "
                                "input city in weather/TOOL.md and weather/index.ts, and check with "
                                "`sandboxd validate weather`)"]
    assert main(["validate", "weather", "--data-path", str(tmp_path / "data")]) == 0
    assert capsys.readouterr().out == "0 errors, 0 warnings\n"


def test_cli_new_with_dir_creates_missing_parents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["new", "weather", "--dir", str(tmp_path / "tools" / "mine")]) == 0
    assert (tmp_path / "tools" / "mine" / "weather" / "index.ts").is_file()


def test_cli_new_refusals_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["new", "Weather", "--dir", str(tmp_path)]) == 2
    assert "try: sandboxd new weather" in capsys.readouterr().err
    assert main(["new", "weather", "--dir", str(tmp_path)]) == 0
    assert main(["new", "weather", "--dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
