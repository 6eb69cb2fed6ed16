# EXPLORATION (issue 22): used by compile_check.sh.
# Per kernel of a cuobjdump -sass listing: the code reachable from the entry before any USETMAXREG ("launch"), and
# from each USETMAXREG (its register count) up to the next one or an EXIT, by control flow (branch targets,
# fall-through, BSSY / WARPSYNC targets counted conservatively); per region the highest register index used, the
# local-memory instructions (spills) and the barrier instructions. A region that uses R(n) needs n + 1 registers
# (plus the 2 ptxas reserves are not in R numbering), which must be <= its USETMAXREG value.
import re, sys
from collections import deque

def kernels(txt):
    for fn in re.split(r"\n\s*Function : ", txt)[1:]:
        name = fn.split("\n", 1)[0].strip()
        ins = []
        for l in fn.split("\n"):
            m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", l)
            if m:
                ins.append((int(m.group(1), 16), m.group(2).strip()))
        yield name, ins

def analyse(ins):
    idx = {a: i for i, (a, _) in enumerate(ins)}
    def succ(i):
        a, s = ins[i]
        pred = s.startswith("@")
        body = re.sub(r"^@!?U?P\w+\s+", "", s)
        op = body.split()[0] if body else ""
        out = []
        tg = re.findall(r"0x([0-9a-f]+)", body)
        if op.startswith("BRA") or op.startswith("JMP"):
            out.append(idx.get(int(tg[-1], 16)))
            if pred or "!P" in body or "P" in body.split(",")[0].split()[1:]: out.append(i + 1)
        elif op.startswith("EXIT") or op.startswith("RET") or op.startswith("BRX") or op.startswith("JMX"):
            if pred: out.append(i + 1)
        elif op.startswith("BSSY") or op.startswith("WARPSYNC") or op.startswith("CALL"):
            if tg: out.append(idx.get(int(tg[-1], 16)))
            out.append(i + 1)
        else:
            out.append(i + 1)
        return [j for j in out if j is not None and j < len(ins)]
    starts = [(0, "launch budget")]
    for i, (a, s) in enumerate(ins):
        m = re.search(r"USETMAXREG\.(\S+)\s.*?(0x[0-9a-f]+)\s*$", s)
        if m:
            starts.append((i, f"{m.group(1)} {int(m.group(2), 16)} @0x{a:x}"))
    marks = {i for i, _ in starts[1:]}
    res = []
    for s0, label in starts:
        seen = set(); q = deque([s0])
        while q:
            i = q.popleft()
            if i in seen: continue
            if i != s0 and i in marks: continue
            seen.add(i)
            q.extend(succ(i))
        maxr, stl, ldl, bars = -1, 0, 0, []
        for i in seen:
            s = ins[i][1]
            regs = [int(x) for x in re.findall(r"\bR(\d+)\b", s)]
            if regs: maxr = max(maxr, max(regs))
            stl += " STL" in " " + s or s.startswith("STL"); ldl += "LDL" in s
            if re.search(r"\bBAR\.", s): bars.append(s)
        res.append((label, len(seen), maxr, stl, ldl, bars))
    return res

for name, ins in kernels(open(sys.argv[1]).read()):
    print(name)
    for label, n, maxr, stl, ldl, bars in analyse(ins):
        print(f"   {label:40s} {n:5d} instrs  max R{maxr:<4d} STL {stl} LDL {ldl}  barriers: " +
              ", ".join(sorted(set(re.sub(r"^@!?P\d\s+", "", b).replace('.DEFER_BLOCKING', '') for b in bars))))
