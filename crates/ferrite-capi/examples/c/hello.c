/* The smallest use of ferrite from C: c = a·b on host memory (README.md shows this file). */
#include <ferrite.h>
#include <stdio.h>

int main(void) {
  float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1}, c[4];
  int64_t sa[2] = {2, 3}, sb[2] = {3, 2}, sc[2] = {2, 2};
  FerriteTensor ta = {a, sa, NULL, 2, FERRITE_DTYPE_F32}, tb = {b, sb, NULL, 2, FERRITE_DTYPE_F32};
  FerriteTensor tc = {c, sc, NULL, 2, FERRITE_DTYPE_F32};
  if (ferrite_matmul(ferrite_device_cpu(), &ta, &tb, &tc, 1.0f, 0.0f, false) != FERRITE_STATUS_OK) {
    fprintf(stderr, "ferrite: %s\n", ferrite_last_error());
    return 1;
  }
  printf("%g %g\n%g %g\n", c[0], c[1], c[2], c[3]); /* 4 5 / 10 11 */
  return 0;
}
