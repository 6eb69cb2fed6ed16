# EXPLORATION (issue 22): python3 sbwait.py KERNEL.sass [START_HEX] -- in the 16-head kernel, from START: the LDG groups,
# the barriers, backward branches and every instruction that waits on a scoreboard an LDG writes (the 2c1p_slots finding).
# Producer-region walk (address order): LDG issues (grouped), barrier ops, and instructions that wait on a
# scoreboard some LDG writes, with the mask.
import re, sys
txt = open(sys.argv[1]).read()
fn = [f for f in txt.split("Function : ")[1:] if "ILi16" in f.split("\n")[0]][0]
lines = fn.split("\n")
ins = []
for i, l in enumerate(lines):
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);\s*/\* (0x[0-9a-f]+) \*/", l)
    if m:
        hi = int(re.search(r"/\* (0x[0-9a-f]+) \*/", lines[i + 1]).group(1), 16)
        ins.append((int(m.group(1), 16), m.group(2).strip(), hi))
start = int(sys.argv[2], 16) if len(sys.argv) > 2 else 0
ldg_sbs = {((hi >> 46) & 7) for a, s, hi in ins if "LDG" in s and a >= start}
out, nld = [], 0
for a, s, hi in ins:
    if a < start: continue
    wait = (hi >> 52) & 0x3f
    if "LDG" in s:
        nld += 1; continue
    hits = [b for b in ldg_sbs if wait >> b & 1]
    if nld:
        out.append(f"   {nld} LDG (SB{sorted(ldg_sbs)})"); nld = 0
    if hits or "BAR" in s or "BRA" in s and re.search(r"BRA\s+0x([0-9a-f]+)", s) and int(re.search(r"BRA\s+(?:!?U?P\d,\s*)?0x([0-9a-f]+)", s).group(1), 16) < a:
        out.append(f"{a:#x} {s[:60]}" + (f"   <- waits SB{hits}" if hits else ""))
    if "EXIT" in s and not s.startswith("@"): break
print("\n".join(out))
