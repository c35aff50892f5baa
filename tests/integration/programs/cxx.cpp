// std::vector and std::map allocating through operator new; no iostream (Valgrind runs __libc_freeres).
#include <map>
#include <vector>

__attribute__((noinline)) static std::vector<int> *make_vector(int n)
{
    std::vector<int> *v = new std::vector<int>();
    for (int i = 0; i < n; i++)
        v->push_back(i);
    return v;
}

__attribute__((noinline)) static std::map<int, long> *make_map(int n)
{
    std::map<int, long> *m = new std::map<int, long>();
    for (int i = 0; i < n; i++)
        (*m)[i] = i;
    return m;
}

int main()
{
    std::vector<int> *v = make_vector(1000);
    std::map<int, long> *m = make_map(50);
    int *arr = new int[300];
    arr[0] = 1;
    delete m;
    m = make_map(20);
    (void)v;
    (void)arr;
    return 0;
}
