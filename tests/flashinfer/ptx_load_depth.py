"""How many global loads deep a kernel's data loads are, read from its PTX.

A warp that must wait for one global load before it can issue the next pays a round trip to
memory per hop; with few warps in flight (a decode batch) nothing hides that latency. This
module measures the hops a kernel's first pass takes before it reads its data: for every
``ld.global``, one plus the deepest load among

* the registers its address and its guard predicate are computed from (data dependence), and
* the branch predicates that decide whether its block runs at all (control dependence, from
  the post-dominator tree),

following every instruction in between. Loop back edges lead to a sink ("the next iteration")
instead of the loop's head, so the depths are those of a warp's first iteration, which is the
whole of a decode batch's work, and what follows a loop still waits for the branch that ends it.

"Data loads" are the loads of the FC1 output: 8- or 16-bit elements (the earlier kernel's one
element per thread) or vectors (the current kernel's 128-bit accesses). The index, the padded
total, the scales and the per-expert SwiGLU controls are 32-bit scalars.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

REGISTER = re.compile(r"%[a-z]+\d+")
INSTRUCTION = re.compile(r"^(?:@(!?)(%p\d+)\s+)?([a-z][\w.:]*)\s*(.*)$", re.S)
LABEL = re.compile(r"^(\$?[\w$]+):$")
# Opcodes without a destination register: every register they name is read.
NO_DESTINATION = ("st.", "bra", "ret", "exit", "bar", "barrier", "red.", "prefetch", "membar", "fence",
                  "griddepcontrol", "trap", "call", "pmevent", "cp.async.wait", "cp.async.commit")
DATA_WIDTHS = {"8", "16"}
NEXT_ITERATION = "<next-iteration>"


@dataclass
class Instruction:
    opcode: str
    dests: list[str]
    sources: list[str]
    guard: str | None  # the predicate register of @%p / @!%p
    target: str | None = None  # a branch's label


@dataclass
class Block:
    label: str
    instructions: list[Instruction] = field(default_factory=list)
    successors: list[str] = field(default_factory=list)

    @property
    def branch(self) -> Instruction | None:
        last = self.instructions[-1] if self.instructions else None
        return last if last is not None and last.opcode.startswith("bra") else None


@dataclass(frozen=True)
class Load:
    opcode: str
    depth: int
    is_data: bool


def _split_operands(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "{[(":
            depth += 1
        elif char in "}])":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def parse_instruction(statement: str) -> Instruction | None:
    match = INSTRUCTION.match(statement.strip())
    if not match or statement.lstrip().startswith("."):
        return None
    _, guard, opcode, rest = match.groups()
    operands = _split_operands(rest)
    target = operands[-1] if opcode.startswith("bra") and operands else None
    if opcode.startswith(NO_DESTINATION) or not operands:
        return Instruction(opcode, [], REGISTER.findall(rest), guard, target)
    return Instruction(opcode, REGISTER.findall(operands[0]),
                       [r for op in operands[1:] for r in REGISTER.findall(op)], guard, target)


def parse_blocks(body: str) -> list[Block]:
    """The function body as basic blocks in program order, with their successors."""
    text = re.sub(r"//[^\n]*", "", body)
    statements: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line in ("{", "}") or line.startswith("."):
            continue
        if LABEL.match(line):
            statements.append(line)
        else:
            statements.extend(s.strip() for s in line.split(";") if s.strip())
    blocks = [Block("entry")]
    for statement in statements:
        label = LABEL.match(statement)
        if label:
            blocks.append(Block(label.group(1)))
            continue
        instruction = parse_instruction(statement)
        if instruction is None:
            continue
        blocks[-1].instructions.append(instruction)
        if instruction.opcode.startswith(("bra", "ret", "exit")):
            blocks.append(Block(f"after-{len(blocks)}"))
    for i, block in enumerate(blocks):
        last = block.instructions[-1] if block.instructions else None
        falls_through = i + 1 < len(blocks)
        if last is not None and last.opcode.startswith("bra"):
            block.successors.append(last.target)
            falls_through = falls_through and last.guard is not None
        elif last is not None and last.opcode.startswith(("ret", "exit")):
            falls_through = False
        if falls_through:
            block.successors.append(blocks[i + 1].label)
    return blocks


def _dominators(order: list[str], preds: dict[str, list[str]], entry: str) -> dict[str, set[str]]:
    dom = {n: set(order) for n in order}
    dom[entry] = {entry}
    changed = True
    while changed:
        changed = False
        for n in order:
            if n == entry:
                continue
            incoming = [dom[p] for p in preds[n] if p in dom]
            new = (set.intersection(*incoming) if incoming else set()) | {n}
            if new != dom[n]:
                dom[n], changed = new, True
    return dom


def _first_pass_graph(blocks: list[Block]) -> tuple[list[str], dict[str, list[str]]]:
    """Blocks reachable from the entry, in topological order, with every loop back edge led to
    one sink, NEXT_ITERATION, instead of the loop's head."""
    succ = {b.label: b.successors for b in blocks}
    reachable, stack = [], [blocks[0].label]
    while stack:
        n = stack.pop()
        if n not in reachable:
            reachable.append(n)
            stack.extend(succ[n])
    order = [b.label for b in blocks if b.label in reachable]
    preds = {n: [p for p in order if n in succ[p]] for n in order}
    dom = _dominators(order, preds, order[0])
    # s dominating n: a back edge, which the first pass leaves for the sink
    dag = {n: list(dict.fromkeys(NEXT_ITERATION if s in dom[n] else s for s in succ[n])) for n in order}
    order.append(NEXT_ITERATION)
    dag[NEXT_ITERATION] = []
    indegree = {n: 0 for n in order}
    for n in order:
        for s in dag[n]:
            indegree[s] += 1
    topo, ready = [], [n for n in order if indegree[n] == 0]
    while ready:
        n = ready.pop(0)
        topo.append(n)
        for s in dag[n]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    return topo, dag


def _controllers(topo: list[str], dag: dict[str, list[str]]) -> dict[str, set[str]]:
    """For every block, the blocks whose branch decides whether it runs (control dependence)."""
    exit_node = "<exit>"
    nodes = topo + [exit_node]
    succ = {n: (dag[n] or [exit_node]) for n in topo}
    succ[exit_node] = []
    pdom = {n: set(nodes) for n in nodes}
    pdom[exit_node] = {exit_node}
    for n in reversed(topo):  # successors first: one pass suffices on a DAG
        pdom[n] = set.intersection(*(pdom[s] for s in succ[n])) | {n}
    ipdom = {n: max(pdom[n] - {n}, key=lambda p: len(pdom[p])) for n in topo}
    controlled: dict[str, set[str]] = {n: set() for n in topo}
    for a in topo:
        if len(succ[a]) < 2:
            continue
        for s in succ[a]:
            n = s
            while n != ipdom[a] and n != exit_node:
                controlled[n].add(a)
                n = ipdom[n]
    return controlled


def is_data_load(opcode: str) -> bool:
    parts = opcode.split(".")
    return any(p in ("v2", "v4", "v8") for p in parts) or (parts[-1][1:] in DATA_WIDTHS)


def load_depths(body: str) -> list[Load]:
    """Every ld.global of the function's first pass, with the global loads it waits for (itself
    included: a load nothing else waits for is at depth 1)."""
    blocks = {b.label: b for b in parse_blocks(body)}
    topo, dag = _first_pass_graph(list(blocks.values()))
    controllers = _controllers(topo, dag)
    depth: dict[str, int] = {}
    branch_depth: dict[str, int] = {}
    loads: list[Load] = []
    for label in topo:
        if label == NEXT_ITERATION:
            continue
        control = max((branch_depth[a] for a in controllers[label] if a in branch_depth), default=0)
        for ins in blocks[label].instructions:
            regs = ins.sources + ([ins.guard] if ins.guard else [])
            inputs = max([control, *(depth.get(r, 0) for r in regs)])
            if ins.opcode.startswith("ld.global"):
                loads.append(Load(ins.opcode, inputs + 1, is_data_load(ins.opcode)))
                inputs += 1
            for d in ins.dests:
                depth[d] = max(depth.get(d, 0), inputs)
        branch = blocks[label].branch
        if branch is not None:
            branch_depth[label] = max(control, depth.get(branch.guard, 0) if branch.guard else 0)
    return loads


def data_load_depth(body: str) -> int:
    """The deepest data load of the first pass (0: the function reads no data)."""
    return max((load.depth for load in load_depths(body) if load.is_data), default=0)
