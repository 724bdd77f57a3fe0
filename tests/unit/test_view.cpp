// Non-owning views: layouts, typed access and validation.
#include <zenflow/view.hpp>

#include <doctest/doctest.h>

#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::dtype;
using zenflow::matrix_view;
using zenflow::memory_space;

TEST_CASE("row-major and column-contiguous layouts address the same logical element") {
  std::vector<float> row_major(12), col_contig(12);
  const auto a = matrix_view::row_major(row_major.data(), 3, 4, dtype::f32);
  const auto b = matrix_view::column_contiguous(col_contig.data(), 3, 4, dtype::f32);
  CHECK(a.is_row_major());
  CHECK(b.is_column_contiguous());
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 4; ++c) {
      row_major[a.offset(r, c)] = static_cast<float>(r * 10 + c);
      col_contig[b.offset(r, c)] = static_cast<float>(r * 10 + c);
    }
  CHECK(row_major[1 * 4 + 2] == 12.0f);
  CHECK(col_contig[2 * 3 + 1] == 12.0f);
  CHECK(a.extent() == 12);
  CHECK_NOTHROW(a.validate("grad"));
  CHECK_NOTHROW(b.validate("grad", memory_space::host));
  zenflow::const_matrix_view ro = a;  // mutable converts to read-only
  CHECK(ro.as<const float>()[5] == row_major[5]);
}

TEST_CASE("malformed views are rejected naming the argument") {
  std::vector<float> data(16);
  auto expect_reject = [](const matrix_view& v, const char* fragment) {
    try {
      v.validate("weight");
      FAIL("accepted a malformed view");
    } catch (const zenflow::error& e) {
      CHECK(e.argument() == "weight");
      CHECK(e.reason().find(fragment) != std::string::npos);
    }
  };
  expect_reject({nullptr, 2, 2, 2, 1, dtype::f32, memory_space::host}, "null");
  expect_reject({data.data(), -1, 2, 2, 1, dtype::f32, memory_space::host}, "extents");
  expect_reject({data.data(), 4, 4, 2, 1, dtype::f32, memory_space::host}, "overlap");
  expect_reject({data.data(), 4, 4, 0, 1, dtype::f32, memory_space::host}, "strides");
  expect_reject({reinterpret_cast<char*>(data.data()) + 1, 2, 2, 2, 1, dtype::f32, memory_space::host}, "aligned");
  expect_reject({data.data(), 2, 2, 2, 1, static_cast<dtype>(9), memory_space::host}, "dtype");
  // Extents whose element count or byte span overflows a 64-bit offset (rows = cols = 2^40).
  const zenflow::index_t huge = zenflow::index_t{1} << 40;
  expect_reject({data.data(), huge, huge, huge, 1, dtype::f32, memory_space::host}, "64-bit offset");
  expect_reject(
      {data.data(), zenflow::index_t{1} << 31, 2, 1, zenflow::index_t{1} << 61, dtype::f32, memory_space::host},
      "64-bit offset");  // the offsets fit, the bytes do not
  const auto ok = matrix_view::row_major(data.data(), 4, 4, dtype::f32, memory_space::device);
  CHECK_THROWS_AS(ok.validate("grad", memory_space::host), zenflow::error);
  CHECK_THROWS_AS((void)ok.as<zenflow::bfloat16>("grad"), zenflow::error);
  // A strided sub-matrix (every other column of an 4 x 8 row-major buffer) is valid.
  std::vector<float> wide(32);
  const matrix_view sub{wide.data(), 4, 4, 8, 2, dtype::f32, memory_space::host};
  CHECK_NOTHROW(sub.validate("grad"));
  // Empty views need no data.
  CHECK_NOTHROW((matrix_view{nullptr, 0, 5, 5, 1, dtype::f32, memory_space::host}.validate("grad")));
}

TEST_CASE("vector views") {
  std::vector<zenflow::bfloat16> bias(7);
  zenflow::vector_view v{bias.data(), 7, dtype::bf16};
  CHECK(v.contiguous());
  CHECK_NOTHROW(v.validate("bias"));
  CHECK(v.as<zenflow::bfloat16>() == bias.data());
  CHECK_THROWS_AS((zenflow::vector_view{nullptr, 3, dtype::f32}.validate("bias")), zenflow::error);
  CHECK_THROWS_AS((zenflow::vector_view{bias.data(), 3, dtype::bf16, memory_space::host, 0}.validate("bias")),
                  zenflow::error);
  CHECK_THROWS_WITH_AS((zenflow::vector_view{bias.data(), zenflow::index_t{1} << 40, dtype::bf16, memory_space::host,
                                             zenflow::index_t{1} << 30}
                            .validate("bias")),
                       doctest::Contains("64-bit offset"), zenflow::error);
}

}  // namespace ZENFLOW_TEST_FILE_ID
