"""An import-linter contract type: no import cycle anywhere inside a package.

import-linter's own ``acyclic_siblings`` compares siblings with their
descendants squashed: it misses a cycle between a package's ``__init__`` and
a module below it, and names packages rather than the modules that loop. This
one looks at every module: any strongly connected component of more than one
module (in-function imports included, as grimp reads every ``import``
statement) breaks it, and the report prints the loop's modules and imports.

Used by ``[tool.importlinter]`` in pyproject.toml (``make lint``)::

    contract_types = ["acyclic: scripts.import_contracts.AcyclicContract"]
"""

from __future__ import annotations

from collections.abc import Iterator

from grimp import ImportGraph
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class AcyclicContract(Contract):
    type_name = "acyclic"

    package = fields.StringField()

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        package = str(self.package)
        modules = {package, *graph.find_descendants(package)}
        imports = {
            module: sorted(graph.find_modules_directly_imported_by(module) & modules)
            for module in modules
        }
        cycles = [sorted(component) for component in _components(imports) if len(component) > 1]
        return ContractCheck(
            kept=not cycles,
            metadata={
                "cycles": [
                    [(module, [i for i in imports[module] if i in cycle]) for module in cycle]
                    for cycle in cycles
                ]
            },
        )

    def render_broken_contract(self, check: ContractCheck) -> None:
        for cycle in check.metadata["cycles"]:
            output.print_error(f"A cycle of {len(cycle)} modules:")
            output.new_line()
            for module, imported in cycle:
                output.indent_cursor()
                output.print(f"{module} imports {', '.join(imported)}")
            output.new_line()


def _components(imports: dict[str, list[str]]) -> Iterator[set[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(imports[root]))]
        index[root] = lowest[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = lowest[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(imports[child])))
                elif child in on_stack:
                    lowest[node] = min(lowest[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowest[parent] = min(lowest[parent], lowest[node])
            if lowest[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                yield component
