"""`tool_choice.allowed_tools` resolved by an index (one pass over the tools, one lookup per
entry) names exactly the tools the entry-by-entry rule (`_tools._matches`) names, in the
tools' order; and a request of thousands of tools and entries is checked in linear work."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from rollout import protocol as p
from rollout.engine._tools import _matches, callable_tools, check_tools, resolve_choice

NAMES = st.sampled_from(["a", "b", "ns.a", "c", "d"])


@st.composite
def tools(draw: st.DrawFn) -> list[p.Tool]:
    out: list[p.Tool] = []
    seen: set[str] = set()
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["function", "custom", "namespace", "shell", "mcp"]))
        name = draw(NAMES.filter(lambda n: "." not in n))
        if kind == "function" and f"f:{name}" not in seen:
            seen.add(f"f:{name}")
            out.append(p.FunctionTool(name=name))
        elif kind == "custom" and f"c:{name}" not in seen:
            seen.add(f"c:{name}")
            out.append(p.CustomTool(name=name))
        elif kind == "namespace" and "ns" not in seen:
            seen.add("ns")
            out.append(p.NamespaceTool(name="ns", description="", tools=[p.FunctionTool(name="a")]))
        elif kind == "shell" and "shell" not in seen:
            seen.add("shell")
            out.append(p.BuiltinTool(type="shell"))
        elif kind == "mcp":
            label = draw(st.sampled_from(["x", "y"]))
            if f"m:{label}" not in seen:
                seen.add(f"m:{label}")
                out.append(p.BuiltinTool(type="mcp", settings={"server_label": label}))
    return out


REFS = st.one_of(
    st.builds(
        lambda kind, name: {"type": kind, "name": name},
        st.sampled_from(["function", "custom"]),
        NAMES | st.integers() | st.lists(st.integers(), max_size=1),
    ),
    st.builds(
        lambda label: {"type": "mcp", "server_label": label}, st.sampled_from(["x", "y", "z"])
    ),
    st.builds(lambda kind: {"type": kind}, st.sampled_from(["shell", "mcp", "web_search"])),
)


@given(tools(), st.lists(REFS, max_size=5), st.sampled_from(["auto", "required"]))
def test_the_index_names_what_the_rule_names(
    declared: list[p.Tool], refs: list[dict[str, Any]], mode: str
) -> None:
    choice = p.ToolChoiceAllowed(mode=mode, tools=refs)  # type: ignore[arg-type]
    every = callable_tools(declared)
    expected = [c for c in every if any(_matches(c, ref) for ref in refs)]
    assert list(resolve_choice(choice, declared).tools) == expected


def test_thousands_of_tools_and_entries_are_checked_in_linear_work() -> None:
    """4,000 tools and as many entries (a 446 KB body took 39 s of the event loop when each
    entry scanned every tool): now one pass and one lookup each."""
    n = 4_000
    declared: list[p.Tool] = [p.FunctionTool(name=f"tool_{i}") for i in range(n)]
    refs = [{"type": "function", "name": f"tool_{i}"} for i in range(n)]
    choice = p.ToolChoiceAllowed(mode="auto", tools=refs)
    calls = 0
    import rollout.engine._tools as tools_module

    rule = tools_module._matches

    def counted(entry: Any, ref: Any) -> bool:
        nonlocal calls
        calls += 1
        return rule(entry, ref)

    tools_module._matches = counted  # type: ignore[assignment]
    try:
        check_tools(declared, choice, hosted=(), schemas_known=True)
        assert len(resolve_choice(choice, declared).tools) == n
    finally:
        tools_module._matches = rule  # type: ignore[assignment]
    assert calls == 0  # the entry-by-entry rule (n x n comparisons) never runs
