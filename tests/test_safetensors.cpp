// Safetensors reader: valid files read back exactly; each rule of the specification, broken by a
// hand-made file, gives a twell::Error that names the tensor (or the header problem).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "twell/bf16.h"
#include "twell/error.h"
#include "twell/safetensors.h"

namespace twell {
namespace {

std::vector<std::byte> make_image(const std::string& header, const std::vector<uint8_t>& data, uint64_t declared_length) {
  std::vector<std::byte> image(8 + header.size() + data.size());
  for (int i = 0; i < 8; ++i) image[i] = std::byte((declared_length >> (8 * i)) & 0xff);
  std::memcpy(image.data() + 8, header.data(), header.size());
  std::memcpy(image.data() + 8 + header.size(), data.data(), data.size());
  return image;
}
std::vector<std::byte> make_image(const std::string& header, const std::vector<uint8_t>& data) {
  return make_image(header, data, header.size());
}

// Expects from_bytes to throw twell::Error whose message contains `needle`.
void expect_refused(const std::string& header, const std::vector<uint8_t>& data, const std::string& needle) {
  try {
    SafetensorsFile::from_bytes(make_image(header, data), "test.safetensors");
    ADD_FAILURE() << "accepted: " << header;
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
  }
}

std::vector<uint8_t> bytes_of(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * 4);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

TEST(Safetensors, ReadsTensorsAndMetadata) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> a(6), b(3);
  for (float& v : a) v = normal(rng);
  std::vector<uint8_t> data = bytes_of(a);
  std::vector<uint16_t> b_bits(3);
  for (int i = 0; i < 3; ++i) {
    b[i] = normal(rng);
    b_bits[i] = float_to_bf16_bits(b[i]);
  }
  data.resize(24 + 6);
  std::memcpy(data.data() + 24, b_bits.data(), 6);
  // Header padded with spaces, as the specification allows.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[24,30]}}    )";
  SafetensorsFile file = SafetensorsFile::from_bytes(make_image(header, data), "ok");
  ASSERT_EQ(file.tensors().size(), 2u);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  const TensorView& view_a = file.get("a");
  EXPECT_EQ(view_a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(to_float_vector(view_a), a);
  std::vector<float> b_read = to_float_vector(file.get("b"));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(b_read[i], round_to_bf16(b[i]));
  EXPECT_THROW(file.get("c"), Error);
}

TEST(Safetensors, ConvertsHalfExactly) {
  // 1.0, -2.5, smallest subnormal 2^-24, largest normal 65504, +inf, -0.
  const std::vector<uint16_t> bits = {0x3c00, 0xc100, 0x0001, 0x7bff, 0x7c00, 0x8000};
  const std::vector<float> expected = {1.0f, -2.5f, std::ldexp(1.0f, -24), 65504.0f, INFINITY, -0.0f};
  std::vector<uint8_t> data(bits.size() * 2);
  std::memcpy(data.data(), bits.data(), data.size());
  SafetensorsFile file = SafetensorsFile::from_bytes(
      make_image(R"({"h":{"dtype":"F16","shape":[6],"data_offsets":[0,12]}})", data), "half");
  std::vector<float> got = to_float_vector(file.get("h"));
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(got[i], expected[i]) << i;
    EXPECT_EQ(std::signbit(got[i]), std::signbit(expected[i])) << i;
  }
}

TEST(Safetensors, AcceptsEmptyAndScalarTensors) {
  SafetensorsFile file = SafetensorsFile::from_bytes(
      make_image(R"({"empty":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]},)"
                 R"("scalar":{"dtype":"I64","shape":[],"data_offsets":[0,8]}})",
                 std::vector<uint8_t>(8, 1)),
      "edge");
  EXPECT_EQ(file.get("empty").numel(), 0);
  EXPECT_EQ(file.get("scalar").numel(), 1);
  EXPECT_THROW(to_float_vector(file.get("scalar")), Error);  // I64 is not a float dtype
}

TEST(Safetensors, RefusesMalformedFiles) {
  const std::vector<uint8_t> data8(8, 0);
  // File structure.
  EXPECT_THROW(SafetensorsFile::from_bytes(std::vector<std::byte>(5), "short"), Error);
  {
    auto image = make_image("{}", {}, 200'000'000);
    EXPECT_THROW(SafetensorsFile::from_bytes(image, "huge"), Error);
  }
  {
    auto image = make_image("{}", {}, 3);  // longer than the file
    EXPECT_THROW(SafetensorsFile::from_bytes(image, "long"), Error);
  }
  expect_refused(R"(["a"])", {}, "must start with");
  expect_refused(R"({"a":)", {}, "not valid JSON");
  expect_refused("{\"a\xff\":1}", {}, "not valid JSON");  // invalid UTF-8
  expect_refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                 data8, "'a' twice");
  // Entries.
  expect_refused(R"({"w":{"dtype":"F8","shape":[2],"data_offsets":[0,8]}})", data8, "tensor 'w': unknown dtype 'F8'");
  expect_refused(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8, "tensor 'w': shape [3] of F32 needs 12");
  expect_refused(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8, "tensor 'w': shape entries");
  expect_refused(R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", data8, "tensor 'w': shape entries");
  expect_refused(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", data8, "tensor 'w': data_offsets [8, 0]");
  expect_refused(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data8, "tensor 'w': data_offsets [0, 16] reach past");
  expect_refused(R"({"w":{"dtype":"F32","shape":[2]}})", data8, "tensor 'w': 'data_offsets'");
  expect_refused(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1}})", data8, "tensor 'w': unknown key 'extra'");
  expect_refused(R"({"w":[1,2]})", data8, "tensor 'w': entry must be an object");
  expect_refused(R"({"w":{"dtype":"U8","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", data8, "tensor 'w': element count overflows");
  expect_refused(R"({"__metadata__":{"k":1}})", {}, "__metadata__ value of 'k'");
  // Ranges: overlap, hole, trailing bytes.
  expect_refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                 data8, "tensor 'b': data_offsets [4, 8] overlap");
  expect_refused(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data8, "tensor 'a': data_offsets [4, 8] leave a hole");
  expect_refused(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", data8, "tensors cover only 4");
}

TEST(Safetensors, RandomCorruptionsNeverCrash) {
  // Flip random header bytes of a valid file: the reader must either accept or throw twell::Error.
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[24,30]}})";
  const std::vector<std::byte> valid = make_image(header, std::vector<uint8_t>(30, 7));
  std::mt19937 rng(3);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<std::byte> image = valid;
    const int flips = 1 + trial % 4;
    for (int f = 0; f < flips; ++f) image[rng() % (8 + header.size())] = std::byte(rng() & 0xff);
    try {
      SafetensorsFile file = SafetensorsFile::from_bytes(image, "fuzz");
      for (const auto& [name, view] : file.tensors())
        ASSERT_EQ(view.bytes, view.numel() * dtype_size(view.dtype)) << name;
    } catch (const Error&) {
    }
  }
}

class SafetensorsOnDisk : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("twell_st_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void write(const std::string& name, const std::vector<std::byte>& bytes) {
    std::ofstream(dir_ / name, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  void write_text(const std::string& name, const std::string& text) { std::ofstream(dir_ / name) << text; }
  std::filesystem::path dir_;
};

TEST_F(SafetensorsOnDisk, OpensSingleFileAndShards) {
  write("model-1.safetensors",
        make_image(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", bytes_of({1.5f})));
  write("model-2.safetensors",
        make_image(R"({"y":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", bytes_of({2.5f, -3.0f})));
  write_text("model.safetensors.index.json",
             R"({"metadata":{},"weight_map":{"x":"model-1.safetensors","y":"model-2.safetensors"}})");
  Checkpoint checkpoint = Checkpoint::open_dir(dir_.string());
  EXPECT_EQ(checkpoint.names(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(to_float_vector(checkpoint.get("y")), (std::vector<float>{2.5f, -3.0f}));
  EXPECT_THROW(checkpoint.get("z"), Error);

  write_text("model.safetensors.index.json", R"({"weight_map":{"x":"model-2.safetensors"}})");
  EXPECT_THROW(Checkpoint::open_dir(dir_.string()), Error);
  write_text("model.safetensors.index.json", R"({"weight_map":{"x":"../model-1.safetensors"}})");
  EXPECT_THROW(Checkpoint::open_dir(dir_.string()), Error);
}

TEST_F(SafetensorsOnDisk, RefusesMissingAndTruncatedFiles) {
  EXPECT_THROW(Checkpoint::open_dir(dir_.string()), Error);
  std::vector<std::byte> image =
      make_image(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", bytes_of({1.0f, 2.0f}));
  image.resize(image.size() - 1);
  write("model.safetensors", image);
  EXPECT_THROW(Checkpoint::open_dir(dir_.string()), Error);
  write("model.safetensors", {});
  EXPECT_THROW(Checkpoint::open_dir(dir_.string()), Error);
}

}  // namespace
}  // namespace twell
