/* main.c — the teacher-dump CLI (placeholder until its issue lands). */
#include <stdio.h>

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "teacher-dump: not built yet (see the open issues)\n");
    return 2;
}
