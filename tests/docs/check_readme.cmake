# The README's usage example must be examples/quickstart.cpp verbatim (cmake -P script).
# Inputs: README, EXAMPLE
file(READ "${README}" readme)
file(READ "${EXAMPLE}" example)
string(FIND "${readme}" "<!-- quickstart -->\n```cpp\n${example}```" at)
if(at EQUAL -1)
  message(FATAL_ERROR "README.md's usage example differs from examples/quickstart.cpp: copy the file into the README")
endif()
file(STRINGS "${EXAMPLE}" lines)
list(LENGTH lines count)
message(STATUS "README usage example matches examples/quickstart.cpp (${count} lines)")
