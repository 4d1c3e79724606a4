/* main.c — the student-train CLI (placeholder until its issue lands). */
#include <stdio.h>

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "student-train: not built yet (see the open issues)\n");
    return 2;
}
