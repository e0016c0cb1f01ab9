"""No module of the engine takes part in an import cycle (counting imports inside functions too; an
`if TYPE_CHECKING:` import names types only and is left out). import-linter's layers contract in
pyproject.toml orders the main modules; this test covers every module, listed there or not."""

from __future__ import annotations

import grimp


def _cycles(graph, modules: list[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    succ = {m: [n for n in graph.find_modules_directly_imported_by(m) if n in modules] for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter
                counter += 1
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(succ[w])))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return out


def test_the_cycle_finder_finds_a_cycle():
    class Graph:
        edges = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}

        def find_modules_directly_imported_by(self, m):
            return self.edges[m]

    assert _cycles(Graph(), ["a", "b", "c", "d"]) == [["a", "b", "c"]]


def test_no_engine_module_is_in_an_import_cycle():
    graph = grimp.build_graph("minecart.engine", include_external_packages=False,
                              exclude_type_checking_imports=True)
    modules = sorted(graph.modules)
    assert len(modules) > 30
    assert _cycles(graph, modules) == []
