// A value a user gave (a config's text, a flag's), as an error message quotes it.
#pragma once

#include <string>
#include <string_view>

namespace moe {

// Its first 64 bytes (excerpt), a newline or tab written \n or \t, and a character that shows as
// a blank or not at all although it is none of those (a no-break space, the Unicode spaces, the
// zero-width and direction marks, a byte-order mark) as \uXXXX: the message stays on one line and
// short, and shows what the value holds (moe::Error escapes the other control characters).
std::string printable(std::string_view value);

}  // namespace moe
