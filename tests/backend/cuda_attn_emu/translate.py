#!/usr/bin/env python3
"""Turn kernels/cuda/attn.cu into C++ for the CPU emulation of its kernels
(test_cuda_attn_emu): kernel launches become emu_launch() calls and dynamic
shared memory a pointer to the block's buffer. Nothing else changes, so the
emulated code is the code the GPU runs.

    translate.py attn.cu out.cpp
"""
import re
import sys

src = open(sys.argv[1]).read()
launch = re.compile(r"(\w+(?:<[^<>;]*>)?)<<<(.*?)>>>\((.*?)\);", re.S)
out, n = launch.subn(lambda m: "emu_launch(%s, [&] { %s(%s); });" % (m.group(2), m.group(1), m.group(3)), src)
shared = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?([\w ]+?) (\w+)\[\];")
out, k = shared.subn(lambda m: "%s *%s = (%s *)emu_smem;" % (m.group(1), m.group(2), m.group(1)), out)
if n == 0 or k == 0:
    sys.exit("translate.py: no launches (%d) or shared arrays (%d) found" % (n, k))
open(sys.argv[2], "w").write('#line 1 "%s"\n' % sys.argv[1] + out)
