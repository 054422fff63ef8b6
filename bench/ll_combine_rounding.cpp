// bench/ll_combine_rounding.cpp (standalone, CPU: g++ -O2 -o /tmp/r bench/ll_combine_rounding.cpp && /tmp/r;
// not part of the build). Accuracy of the ll combine modes at ll-v3 (T 128, H 7168, top-8 of 256 experts on 2 ranks, uniform
// routing, softmax weights, N(0,1) bf16 expert outputs): column (fp32 column-order sum, one bf16
// rounding), partial_fp32 ((0 + p0) + p1 in fp32, one rounding), partial_bf16 (each rank's partial
// rounded to bf16 first), against a float64 reference; several seeds.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include <algorithm>
static float bf16(float f) { uint32_t u; std::memcpy(&u, &f, 4); u += 0x7fffu + ((u >> 16) & 1u); u &= 0xffff0000u; float r; std::memcpy(&r, &u, 4); return r; }
int main() {
  const int T = 128, H = 7168, K = 8, E = 256, R = 2;
  for (int seed = 1; seed <= 3; ++seed) {
    std::mt19937_64 g(seed);
    std::normal_distribution<float> nd;
    double err[3] = {0, 0, 0}, nref = 0, maxe[3] = {0, 0, 0}; long diff[3] = {0, 0, 0}; long n = 0;
    for (int t = 0; t < T; ++t) {
      std::vector<int> all(E); for (int i = 0; i < E; ++i) all[i] = i;
      std::shuffle(all.begin(), all.end(), g);
      int ids[K]; float w[K], s = 0;
      for (int k = 0; k < K; ++k) { ids[k] = all[k]; w[k] = std::exp(nd(g)); s += w[k]; }
      for (int k = 0; k < K; ++k) w[k] /= s;
      bool has[R] = {false, false};
      for (int k = 0; k < K; ++k) has[ids[k] / (E / R)] = true;
      for (int h = 0; h < H; ++h) {
        float y[K]; double ref = 0; float col = 0, part[R] = {0, 0};
        for (int k = 0; k < K; ++k) { y[k] = bf16(nd(g)); ref += (double)w[k] * y[k]; float p = w[k] * y[k]; col = col + p; part[ids[k] / (E / R)] += p; }
        float acc32 = 0, acc16 = 0;
        for (int r = 0; r < R; ++r) if (has[r]) { acc32 = acc32 + part[r]; acc16 = acc16 + bf16(part[r]); }
        float o[3] = {bf16(col), bf16(acc32), bf16(acc16)};
        for (int m = 0; m < 3; ++m) {
          err[m] += (o[m] - ref) * (o[m] - ref);
          diff[m] += o[m] != o[0];
          maxe[m] = std::max(maxe[m], std::fabs(o[m] - ref));
        }
        nref += ref * ref; ++n;
      }
    }
    const char* names[3] = {"column", "partial_fp32", "partial_bf16"};
    for (int m = 0; m < 3; ++m)
      std::printf("seed %d %-13s rel L2 vs float64 %.3e; max |out - ref| / rms(ref) %.3e; %.4f %% of elements differ from column\n", seed, names[m],
                  std::sqrt(err[m] / nref), maxe[m] / std::sqrt(nref / n), 100.0 * diff[m] / n);
  }
}
