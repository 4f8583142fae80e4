// Safetensors files: the tensor-file format of moe_run and of checkpoints.
//
// Layout: an 8-byte little-endian header size N, N bytes of JSON
//   {"name": {"dtype": "BF16" | "F32" | "I32" | "I64", "shape": [...], "data_offsets": [begin,
//   end]},
//    ..., "__metadata__": {"key": "value", ...}}
// then the tensors' bytes, offsets relative to the end of the header.
//
// A file is accepted only as the format specifies it: the header a JSON object without repeated
// keys, each tensor's byte count equal to dtype × shape, and the tensors' byte ranges covering the
// data section exactly (contiguous, no overlap, no gap, no trailing bytes). Every size read from
// a file is checked for overflow before it is used.
//
// Three ways in and out:
//   TensorFile        every tensor held in memory: read whole, built with add(), written whole;
//   TensorFileReader  the header alone read and checked; the data stay on disk and are read by
//                     element ranges, so a rank reads its experts' slice of a 45 GB file only;
//   TensorFileWriter  the header written first (the shapes are known up front), then each
//                     tensor's bytes appended in pieces, so a writer never holds a whole tensor.
// TensorFile and TensorFileReader are both a TensorSource: code that only reads (the layer files'
// checks, the reference's expert streaming) takes either.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe/tensor.h"

namespace moe {

enum class FileDType { kBF16, kF32, kI32, kI64 };

std::size_t file_dtype_size(FileDType dtype);
std::string_view file_dtype_name(FileDType dtype);  // "BF16", "F32", "I32", "I64"

struct FileTensor {
  FileDType dtype = FileDType::kF32;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;

  // Throws moe::Error when a dimension is negative or the product overflows int64.
  std::int64_t numel() const;
  // The view as a moe::Tensor over the host bytes (I64 has no moe::DType: an error).
  Tensor view();
};

// What a header says of one tensor, without its data.
struct TensorInfo {
  FileDType dtype = FileDType::kF32;
  std::vector<std::int64_t> shape;
  std::int64_t numel = 0;  // the product of shape, checked when the header was read
};

// One tensor a TensorFileWriter will write: name, dtype and shape, its data to come.
struct TensorSpec {
  std::string name;
  FileDType dtype = FileDType::kF32;
  std::vector<std::int64_t> shape;
};

// The header's bound, the one the format's reference implementation enforces. A header lists
// tensors, not their data (a million tensors' entries fit in well under 100 MB); without a bound
// a corrupt length field would make the reader allocate and scan up to the whole file as JSON.
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
// The default bound on a whole file read from disk: 64 GiB holds one layer of the largest shape
// in configs/ in F32 (deepseek-v3: w13 and w2 together 45 GB, its results file the same), and
// stops a corrupt or hostile size from exhausting memory. TensorFile::read and TensorFileReader
// take another bound.
inline constexpr std::uint64_t kMaxTensorFileBytes = std::uint64_t{64} << 30;

// The reading side shared by a file in memory and a file on disk. Element ranges are of the
// tensor flattened in row-major order; every range is checked in 64 bits against the tensor
// before a byte is read, and one outside it is a moe::Error naming the file, the tensor, the range
// and the tensor's size.
class TensorSource {
 public:
  virtual ~TensorSource() = default;

  // Where the tensors come from (a path, or the source given to TensorFile::parse).
  virtual const std::string& source() const = 0;
  // Every tensor's name, in name order.
  virtual std::vector<std::string> names() const = 0;
  virtual bool contains(const std::string& name) const = 0;
  // Throws moe::Error naming the tensor and the file when absent.
  virtual TensorInfo info(const std::string& name) const = 0;

  // Throws the error read_range() would throw for this range; returns the tensor's info.
  TensorInfo check_range(const std::string& name, std::int64_t first, std::int64_t count) const;
  // Elements [first, first + count) of tensor `name` into `out`, which must hold exactly
  // count × the dtype's size bytes.
  void read_into(const std::string& name, std::int64_t first, std::int64_t count,
                 std::span<std::byte> out) const;
  // Elements [first, first + count) as a tensor of shape [count].
  FileTensor read_range(const std::string& name, std::int64_t first, std::int64_t count) const;
  // Rows [first_row, first_row + rows) along the first dimension, as a tensor of shape
  // [rows, the other dimensions...]: experts of a [E, 2F, H] stack, tokens of a [T, H] batch.
  FileTensor read_rows(const std::string& name, std::int64_t first_row, std::int64_t rows) const;
  // The whole tensor.
  FileTensor read_tensor(const std::string& name) const;

 protected:
  TensorSource() = default;
  TensorSource(const TensorSource&) = default;
  TensorSource& operator=(const TensorSource&) = default;

 private:
  // out.size() bytes from byte `offset` of the tensor's data; the range was checked against it.
  virtual void read_bytes(const std::string& name, std::uint64_t offset,
                          std::span<std::byte> out) const = 0;
};

class TensorFile final : public TensorSource {
 public:
  // Throws moe::Error naming the file, the tensor or key, and the offending value: short file,
  // header length beyond the file or kMaxHeaderBytes, bad JSON, a repeated key, unknown dtype or
  // entry field, offsets outside the data, not matching dtype × shape, overlapping, leaving gaps
  // or not covering the data section; for read(), also a path that is not a regular file or a
  // file larger than max_bytes. Tensors are read from the file straight into their buffers.
  static TensorFile read(const std::filesystem::path& path,
                         std::uint64_t max_bytes = kMaxTensorFileBytes);
  static TensorFile parse(std::string_view bytes, std::string_view source = "<memory>");
  // The bytes of serialize(), written without first being gathered into one string.
  void write(const std::filesystem::path& path) const;
  std::string serialize() const;

  void add(const std::string& name, FileDType dtype, std::vector<std::int64_t> shape,
           const void* data);
  bool contains(const std::string& name) const override { return tensors_.count(name) != 0; }
  // Throws moe::Error naming the tensor (and the file it came from) when absent.
  const FileTensor& get(const std::string& name) const;
  FileTensor& get(const std::string& name);
  const std::map<std::string, FileTensor>& tensors() const { return tensors_; }
  // Where the tensors came from: the path given to read(), the source given to parse(), or
  // "<memory>" for a file built with add().
  const std::string& source() const override { return source_; }
  std::vector<std::string> names() const override;
  // Also throws when the tensor's bytes do not match its dtype × shape (the fields are public).
  TensorInfo info(const std::string& name) const override;
  std::map<std::string, std::string> metadata;

 private:
  void read_bytes(const std::string& name, std::uint64_t offset,
                  std::span<std::byte> out) const override;

  std::string source_ = "<memory>";
  std::map<std::string, FileTensor> tensors_;
};

class InputFile;

// A file on disk whose header was read and checked, exactly as TensorFile::read checks it (the
// same errors, word for word), and whose data are read only when asked. The file stays open, so
// every later read sees the file the header described. Move-only.
class TensorFileReader final : public TensorSource {
 public:
  explicit TensorFileReader(const std::filesystem::path& path,
                            std::uint64_t max_bytes = kMaxTensorFileBytes);
  ~TensorFileReader() override;
  TensorFileReader(TensorFileReader&&) noexcept;
  TensorFileReader& operator=(TensorFileReader&&) noexcept;

  const std::string& source() const override { return source_; }
  std::vector<std::string> names() const override;
  bool contains(const std::string& name) const override { return entries_.count(name) != 0; }
  TensorInfo info(const std::string& name) const override;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Where the data section starts in the file, and [begin, end) of a tensor's bytes in it, as
  // the header gives them.
  std::uint64_t data_start() const { return data_start_; }
  std::pair<std::uint64_t, std::uint64_t> data_offsets(const std::string& name) const;

 private:
  struct Entry {
    TensorInfo info;
    std::uint64_t begin = 0;
    std::uint64_t end = 0;
  };
  const Entry& entry(const std::string& name) const;
  void read_bytes(const std::string& name, std::uint64_t offset,
                  std::span<std::byte> out) const override;

  std::string source_;
  std::unique_ptr<InputFile> file_;
  std::uint64_t data_start_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes a file whose tensors are known up front: the constructor writes the header (the very
// header TensorFile::write writes for tensors of these names, dtypes and shapes: data in name
// order), then append() adds each tensor's bytes in pieces. Tensors may be filled in any order,
// one after another or interleaved; within a tensor the pieces follow in order. finish() checks
// that every tensor got all its bytes. The bytes go to a file beside the target, which finish()
// renames onto it (one atomic step): a writer that fails, or is destroyed before finish()
// succeeded, removes its file and leaves whatever the target held untouched; and until finish()
// the file's length prefix is zero, which no reader accepts, so not even a process killed
// mid-write leaves a file that reads as complete.
// The longest name of one file that the file systems in use take.
inline constexpr std::size_t kMaxFileNameBytes = 255;

// Refuses a path that a results file could not be written to, naming it as `what` ("tensor file
// 'r.safetensors'", "--out 'r.safetensors'"): a symbolic link that leads nowhere (a missing
// target or a loop), an existing target that is a directory or anything but a regular file (a
// FIFO, a device), a directory that does not exist, or a file name longer than file systems
// take. Reads file status only; TensorFileWriter checks its path with it, and the apps check
// their output options with it before they run.
void check_output_path(const std::filesystem::path& path, std::string_view what);

class TensorFileWriter {
 public:
  // Throws moe::Error naming the tensor for an invalid or repeated name or a shape whose byte
  // count is negative or overflows, and naming the path when it cannot be created.
  TensorFileWriter(const std::filesystem::path& path, std::vector<TensorSpec> tensors,
                   std::map<std::string, std::string> metadata = {});
  ~TensorFileWriter();
  TensorFileWriter(const TensorFileWriter&) = delete;
  TensorFileWriter& operator=(const TensorFileWriter&) = delete;

  // The next bytes of tensor `name`. Throws moe::Error naming the file and the tensor for an
  // unknown tensor, bytes past its end, or a write that fails.
  void append(const std::string& name, std::span<const std::byte> bytes);
  void append(const std::string& name, const void* data, std::size_t bytes) {
    append(name, std::span(static_cast<const std::byte*>(data), bytes));
  }
  // Bytes of tensor `name` not yet appended.
  std::uint64_t remaining(const std::string& name) const;
  // From here on, append() refuses BF16 and F32 bytes that hold a NaN or an Inf: the writer then
  // fails, its file removed, naming the tensor and the first such element's index and value.
  // Pieces must then hold whole elements.
  void refuse_non_finite() { refuse_non_finite_ = true; }
  // Throws moe::Error naming the first tensor that is not complete and its byte counts, or when
  // closing the file fails; the file is then removed.
  void finish();
  // The file being written, beside the target, until finish() renames it over the target. A
  // process that a signal ends runs no destructor: an app that handles the signal removes it.
  const std::filesystem::path& writing_path() const { return writing_; }

 private:
  struct Slot {
    std::uint64_t begin = 0;  // in the file
    std::uint64_t bytes = 0;
    std::uint64_t written = 0;
    FileDType dtype = FileDType::kF32;
    std::vector<std::int64_t> shape;
  };
  const Slot& slot(const std::string& name) const;
  Slot& slot(const std::string& name);
  // Throws (the caller discards) at the first NaN or Inf among `bytes`, the next of slot `s`.
  void check_finite(const std::string& name, const Slot& s, std::span<const std::byte> bytes) const;
  // Closes and removes the file being written: a writer that failed or was abandoned leaves no
  // trace.
  void discard() noexcept;

  std::filesystem::path path_;     // the target, as named (messages)
  std::filesystem::path target_;   // the target with its links resolved: what finish() replaces
  std::filesystem::path writing_;  // the file being written, beside the target
  int fd_ = -1;
  bool finished_ = false;
  bool refuse_non_finite_ = false;
  std::array<std::byte, 8> length_prefix_{};  // written by finish()
  std::map<std::string, Slot> slots_;
};

}  // namespace moe
