// C++: templates, methods, constructors and std containers (Valgrind demangles symbol names,
// and names inlined levels with their DWARF names).
#include <map>
#include <string>
#include <vector>
#include "record.h"

namespace ns {
template <typename T> struct Box {
    std::vector<T> items;
    __attribute__((noinline)) void grow(int n)
    {
        for (int i = 0; i < n; ++i)
            items.push_back(T(i));
    }
};
struct Widget {
    int *data;
    Widget() : data(new int[10]) {}
    ~Widget() { delete[] data; }
};
}  // namespace ns

ns::Widget *volatile keep;

int main(int argc, char **argv)
{
    ns::Box<int> a;
    a.grow(100);
    ns::Box<long> b;
    b.grow(7);
    std::map<std::string, int> m;
    m["a key long enough to need a heap block"] = 1;
    keep = new ns::Widget();
    if (argc > 1)
        copy_maps(argv[1]);
    return 0;
}
