// Links the per-header translation units (each generated from one public header) into one program.
#include <cstdio>
int main() {
  std::puts("every public zenflow header compiled on its own");
  return 0;
}
