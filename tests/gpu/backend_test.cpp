// The cuda backend's memory and transfers: the same allocations give the same ledger and
// arena as on the meta backend; host round trips in f32 and bf16 (bf16 bit-exact to
// float_to_bf16); copies and sums between two backends on one GPU; an arena the GPU
// cannot hold is a config_error that says what to do.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "core/error.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

class cuda_backend_test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

constexpr memory_limits gpu_limits{std::size_t{256} << 20, std::size_t{64} << 20};

std::string memory_type(const void* p) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return "unknown";
  }
  switch (attributes.type) {
    case cudaMemoryTypeDevice: return "device";
    case cudaMemoryTypeHost: return "host";
    case cudaMemoryTypeManaged: return "managed";
    default: return "unregistered";
  }
}

// One allocation of the scripted sequence: what the meta and cuda backends are asked.
struct request {
  mem_tag tag;
  dtype type;
  shape dims;
};

request random_request(std::mt19937& rng) {
  constexpr std::array tags{mem_tag::weights, mem_tag::grads,     mem_tag::activations, mem_tag::attention,
                            mem_tag::comm,    mem_tag::workspace, mem_tag::checkpoints_device,
                            mem_tag::checkpoints_host};
  constexpr std::array types{dtype::f32, dtype::bf16, dtype::i32};
  std::uniform_int_distribution<std::int64_t> rows(0, 300), cols(1, 4099);
  return {tags[rng() % tags.size()], types[rng() % types.size()], shape{rows(rng), cols(rng)}};
}

// The engines' workspaces come first and stay, so they occupy the start of the arena;
// the meta backend with the rest of the capacity must then make every decision the
// cuda backend makes, shifted by the workspaces.
TEST_F(cuda_backend_test, allocations_match_the_meta_backend) {
  auto gpu = make_cuda_backend(gpu_limits, 0);
  const std::size_t engines = gpu->device_arena().in_use();
  ASSERT_GT(engines, 0u) << "the cuBLASLt workspace should be in the arena";
  ASSERT_EQ(gpu->device_arena().high_water(), engines) << "engine workspaces should be packed at the start";
  EXPECT_EQ(gpu->work_dtype(), dtype::bf16);
  std::array<std::size_t, mem_tag_count> base{};
  for (std::size_t i = 0; i < mem_tag_count; ++i) base[i] = gpu->ledger().current(static_cast<mem_tag>(i));
  EXPECT_EQ(base[static_cast<std::size_t>(mem_tag::workspace)], gpu->ledger().device_current());

  auto meta = make_meta_backend({gpu_limits.device_bytes - engines, gpu_limits.host_bytes});
  std::vector<tensor> on_gpu, on_meta;
  std::mt19937 rng(7);
  for (int step = 0; step < 400; ++step) {
    if (!on_gpu.empty() && rng() % 3 == 0) {
      const std::size_t victim = rng() % on_gpu.size();
      on_gpu.erase(on_gpu.begin() + static_cast<std::ptrdiff_t>(victim));
      on_meta.erase(on_meta.begin() + static_cast<std::ptrdiff_t>(victim));
    } else {
      const request r = random_request(rng);
      bool gpu_full = false, meta_full = false;
      try {
        on_gpu.push_back(gpu->allocate(r.tag, r.type, r.dims, "scripted"));
      } catch (const out_of_memory_error&) {
        gpu_full = true;
      }
      try {
        on_meta.push_back(meta->allocate(r.tag, r.type, r.dims, "scripted"));
      } catch (const out_of_memory_error&) {
        meta_full = true;
      }
      ASSERT_EQ(gpu_full, meta_full) << "step " << step;
      if (!gpu_full) {
        const tensor& t = on_gpu.back();
        ASSERT_NE(t.data(), nullptr);
        EXPECT_EQ(memory_type(t.data()), is_host_tag(r.tag) ? "host" : "device") << "step " << step;
      }
    }
    ASSERT_EQ(gpu->device_arena().in_use() - engines, meta->device_arena().in_use()) << "step " << step;
    ASSERT_EQ(gpu->device_arena().high_water() - engines, meta->device_arena().high_water()) << "step " << step;
    ASSERT_EQ(gpu->device_arena().largest_free(), meta->device_arena().largest_free()) << "step " << step;
    ASSERT_EQ(gpu->host_arena().in_use(), meta->host_arena().in_use()) << "step " << step;
    ASSERT_EQ(gpu->host_arena().high_water(), meta->host_arena().high_water()) << "step " << step;
    for (std::size_t i = 0; i < mem_tag_count; ++i) {
      const auto tag = static_cast<mem_tag>(i);
      ASSERT_EQ(gpu->ledger().current(tag) - base[i], meta->ledger().current(tag)) << mem_tag_name(tag);
      ASSERT_EQ(gpu->ledger().peak(tag) - base[i], meta->ledger().peak(tag)) << mem_tag_name(tag);
    }
    const std::size_t workspaces = base[static_cast<std::size_t>(mem_tag::workspace)];
    ASSERT_EQ(gpu->ledger().device_current() - workspaces, meta->ledger().device_current());
    ASSERT_EQ(gpu->ledger().device_peak() - workspaces, meta->ledger().device_peak());
  }
  EXPECT_THROW(gpu->allocate(mem_tag::activations, dtype::f32, {std::int64_t{1} << 30}, "too_big"),
               out_of_memory_error);
}

TEST_F(cuda_backend_test, f32_round_trip_is_exact) {
  auto gpu = make_cuda_backend(gpu_limits, 0);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1e6f, 1e6f);
  for (mem_tag tag : {mem_tag::activations, mem_tag::checkpoints_host}) {
    tensor t = gpu->allocate(tag, dtype::f32, {37, 53}, "round_trip");
    std::vector<float> in(static_cast<std::size_t>(t.numel())), out(in.size(), -1.0f);
    for (float& v : in) v = dist(rng);
    in[0] = -0.0f;
    in[1] = std::numeric_limits<float>::denorm_min();
    in[2] = std::numeric_limits<float>::infinity();
    gpu->upload_f32(t, in.data());
    gpu->download_f32(out.data(), t);
    for (std::size_t i = 0; i < in.size(); ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(out[i]), std::bit_cast<std::uint32_t>(in[i]))
          << mem_tag_name(tag) << " " << i;
  }
}

// Crosses the staging chunk (4M elements) so the chunked path is covered too.
TEST_F(cuda_backend_test, bf16_round_trip_rounds_like_float_to_bf16) {
  auto gpu = make_cuda_backend(gpu_limits, 0);
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> mantissa(-2.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-130, 120);
  for (mem_tag tag : {mem_tag::activations, mem_tag::checkpoints_host}) {
    const std::int64_t n = tag == mem_tag::activations ? (std::int64_t{4} << 20) + 1237 : 4099;
    tensor t = gpu->allocate(tag, dtype::bf16, {n}, "round_trip");
    std::vector<float> in(static_cast<std::size_t>(n)), out(in.size(), -1.0f);
    for (float& v : in) v = std::ldexp(mantissa(rng), exponent(rng));
    const std::array<std::uint32_t, 10> special{0x3f808000u,  // a tie: rounds down to even
                                                0x3f818000u,  // a tie: rounds up to even
                                                0x3f80c000u, 0x7f7fffffu /* rounds to inf */, 0x80000000u,
                                                0x00000001u, 0x7f800000u, 0xff800000u, 0x7fc00001u, 0xffbfffffu};
    for (std::size_t i = 0; i < special.size(); ++i) in[i] = std::bit_cast<float>(special[i]);
    gpu->upload_f32(t, in.data());
    gpu->download_f32(out.data(), t);
    for (std::size_t i = 0; i < in.size(); ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(out[i]), std::bit_cast<std::uint32_t>(round_to_bf16(in[i])))
          << mem_tag_name(tag) << " element " << i << " = " << in[i];
    std::vector<std::uint16_t> raw(static_cast<std::size_t>(n));
    gpu->download_bytes(raw.data(), t, t.bytes());
    for (std::size_t i = 0; i < in.size(); ++i) ASSERT_EQ(raw[i], float_to_bf16(in[i])) << i;
  }
}

TEST_F(cuda_backend_test, bytes_round_trip_and_zeroed_allocations) {
  auto gpu = make_cuda_backend(gpu_limits, 0);
  for (mem_tag tag : {mem_tag::activations, mem_tag::checkpoints_host}) {
    tensor ids = gpu->allocate(tag, dtype::i32, {1001, 1}, "ids");
    std::vector<std::int32_t> in(1001), out(1001, -1);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::int32_t>(i * 2654435761u % 128256u);
    gpu->upload_bytes(ids, in.data(), ids.bytes());
    gpu->download_bytes(out.data(), ids, ids.bytes());
    EXPECT_EQ(in, out) << mem_tag_name(tag);

    tensor zeros = gpu->allocate_zeroed(tag, dtype::f32, {3, 1000}, "zeros");
    std::vector<float> host(3000, 1.0f);
    gpu->download_f32(host.data(), zeros);
    for (float v : host) ASSERT_EQ(v, 0.0f) << mem_tag_name(tag);
    gpu->fill_bytes(zeros.data(), 0xff, zeros.bytes());
    std::vector<std::uint32_t> bits(3000);
    gpu->download_bytes(bits.data(), zeros, zeros.bytes());
    for (std::uint32_t b : bits) ASSERT_EQ(b, 0xffffffffu) << mem_tag_name(tag);
  }
}

// What the threads communicator does between virtual ranks on one GPU.
TEST_F(cuda_backend_test, copies_and_sums_between_two_backends_on_one_gpu) {
  auto first = make_cuda_backend(gpu_limits, 0);
  auto second = make_cuda_backend(gpu_limits, 0);
  const std::int64_t n = 100003;
  tensor src = first->allocate(mem_tag::comm, dtype::f32, {n}, "src");
  tensor dst = second->allocate(mem_tag::comm, dtype::f32, {n}, "dst");
  tensor pinned = second->allocate(mem_tag::checkpoints_host, dtype::f32, {n}, "pinned");
  std::vector<float> a(static_cast<std::size_t>(n)), b(a.size()), out(a.size());
  for (std::int64_t i = 0; i < n; ++i) {
    a[i] = 0.25f * static_cast<float>(i % 977) - 7.0f;
    b[i] = 3.0f - 0.5f * static_cast<float>(i % 331);
  }
  first->upload_f32(src, a.data());
  second->upload_f32(dst, b.data());

  second->add_f32(dst.as<float>(), src.as<float>(), static_cast<std::size_t>(n));
  second->synchronize();
  second->download_f32(out.data(), dst);
  for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], b[i] + a[i]) << i;

  second->copy_bytes(dst.data(), src.data(), src.bytes());
  second->copy_bytes(pinned.data(), src.data(), src.bytes());
  second->synchronize();
  second->download_f32(out.data(), dst);
  EXPECT_EQ(out, a);
  EXPECT_EQ(std::vector<float>(pinned.as<float>(), pinned.as<float>() + n), a);
}

// Side copies to and from a pinned and a pageable host pool (the pageable one through
// the bounce buffers, in several chunks and a ragged last one) bring back every byte, and
// the host pool holds them once synchronized; the compute stream's later work sees the
// restored bytes after join_side_copies().
TEST_F(cuda_backend_test, side_copies_through_pinned_and_pageable_host_pools) {
  for (bool pageable : {false, true}) {
    memory_limits limits{std::size_t{512} << 20, std::size_t{256} << 20};
    limits.host_pageable = pageable;
    auto gpu = make_cuda_backend(limits, 0);
    const std::int64_t n = (std::int64_t{70} << 20) / 4 + 12345;  // 70 MiB and a bit: 3 chunks of 32 MiB
    tensor src = gpu->allocate(mem_tag::activations, dtype::f32, {n}, "src");
    tensor host = gpu->allocate(mem_tag::checkpoints_host, dtype::f32, {n}, "host");
    tensor back = gpu->allocate(mem_tag::activations, dtype::f32, {n}, "back");
    std::vector<float> a(static_cast<std::size_t>(n)), out(a.size());
    for (std::int64_t i = 0; i < n; ++i) a[i] = static_cast<float>(i % 100003) * 0.5f - 11.0f;
    gpu->upload_f32(src, a.data());
    gpu->copy_bytes_side(host.data(), src.data(), src.bytes());
    gpu->join_side_copies();
    gpu->fill_bytes(src.data(), 0, src.bytes());  // ordered after the copy has read src
    gpu->copy_bytes_side(back.data(), host.data(), host.bytes());
    gpu->join_side_copies();
    gpu->add_f32(back.as<float>(), src.as<float>(), static_cast<std::size_t>(n));  // + 0, on the compute stream
    gpu->synchronize();
    gpu->download_f32(out.data(), back);
    EXPECT_EQ(out, a) << (pageable ? "pageable" : "pinned");
    EXPECT_EQ(std::vector<float>(host.as<float>(), host.as<float>() + n), a) << (pageable ? "pageable" : "pinned");
  }
}

TEST_F(cuda_backend_test, sum_squares_of_a_strided_view) {
  auto gpu = make_cuda_backend(gpu_limits, 0);
  tensor t = gpu->allocate(mem_tag::grads, dtype::f32, {67, 130}, "grad");
  std::vector<float> host(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(static_cast<int>(i % 23) - 11) * 0.125f;
  gpu->upload_f32(t, host.data());
  const mat_view view = t.matrix().col_block(1, 128);
  double want = 0.0;
  for (std::int64_t i = 0; i < 67; ++i)
    for (std::int64_t j = 1; j < 129; ++j) want += static_cast<double>(host[i * 130 + j]) * host[i * 130 + j];
  EXPECT_DOUBLE_EQ(ops::sum_squares(*gpu, view), want);
  EXPECT_DOUBLE_EQ(ops::sum_squares(*gpu, view), want) << "a second call must start from zero";
}

TEST_F(cuda_backend_test, an_arena_larger_than_the_gpu_is_a_config_error) {
  std::size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  const std::size_t asked = total_bytes + (std::size_t{4} << 30);
  try {
    make_cuda_backend({asked, 0}, 0);
    FAIL() << "an arena of " << asked << " bytes should not fit";
  } catch (const config_error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(std::to_string(asked)), std::string::npos) << message;
    EXPECT_NE(message.find(std::to_string(total_bytes)), std::string::npos) << message;
    EXPECT_NE(message.find("--memory-gib"), std::string::npos) << message;
    EXPECT_NE(message.find("upipe plan"), std::string::npos) << message;
  }
  // Nothing sticky is left behind: the next backend works.
  auto gpu = make_cuda_backend(gpu_limits, 0);
  tensor t = gpu->allocate(mem_tag::activations, dtype::f32, {4}, "after");
  const std::array<float, 4> in{1, 2, 3, 4};
  std::array<float, 4> out{};
  gpu->upload_f32(t, in.data());
  gpu->download_f32(out.data(), t);
  EXPECT_EQ(in, out);
}

TEST_F(cuda_backend_test, a_missing_gpu_is_a_config_error) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  EXPECT_THROW(make_cuda_backend(gpu_limits, count), config_error);
}

}  // namespace
}  // namespace upipe
