#!/usr/bin/env python3
"""Turn a kernels/cuda/*.cu file into C++ for the CPU emulation of CUDA
(tests/backend/cuda_emu, emu.h): kernel launches become emu_launch() calls
and dynamic shared memory a pointer to the block's buffer. Nothing else
changes, so the emulated code is the code the GPU runs.

    translate.py file.cu out.cpp
"""
import re
import sys

src = open(sys.argv[1]).read()
launch = re.compile(r"(\w+(?:<[^<>;]*>)?)<<<(.*?)>>>\((.*?)\);", re.S)
out, n = launch.subn(lambda m: "emu_launch(%s, [&] { %s(%s); });" % (m.group(2), m.group(1), m.group(3)), src)
shared = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?([\w ]+?) (\w+)\[\];")
out, k = shared.subn(lambda m: "%s *%s = (%s *)emu_smem;" % (m.group(1), m.group(2), m.group(1)), out)
if "<<<" in out or "extern __shared__" in out:
    sys.exit("translate.py: %s: a launch or a shared array the patterns do not cover" % sys.argv[1])
open(sys.argv[2], "w").write('#line 1 "%s"\n' % sys.argv[1] + out)
