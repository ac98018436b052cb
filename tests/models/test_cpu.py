"""eyas.models.cpu: the flags that key kernel builds and tuning caches come from the flags line alone."""

from eyas.models.cpu import parse_flags

_X86 = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
cpu MHz\t\t: 2300.000
cache size\t: 266240 KB
flags\t\t: fpu avx2 avx512f avx512_bf16
bogomips\t: 4600.00

processor\t: 1
cpu MHz\t\t: 2412.118
flags\t\t: fpu avx2
"""


def test_flags_are_the_first_processors_flags_line():
    assert parse_flags(_X86) == frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"})


def test_clock_readings_do_not_change_the_flags():
    other_clock = _X86.replace("2300.000", "3112.455").replace("4600.00", "6224.91")
    assert parse_flags(other_clock) == parse_flags(_X86)


def test_arm_features_line_and_unknown_text():
    assert parse_flags("processor\t: 0\nFeatures\t: fp asimd sve\n") == frozenset({"fp", "asimd", "sve"})
    assert parse_flags("nothing useful here\n") == frozenset()
